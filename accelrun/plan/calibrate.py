"""Measure this machine and describe it as a cluster: ``accelrun plan --calibrate``.

Probes (each the median of a few timed repeats):

- matmul rate at several widths ``w``: ``(rows × w) @ (w × w)`` in the three layouts training uses
  (forward ``X·W``, input gradient ``dY·Wᵀ``, weight gradient ``Xᵀ·dY``), fp32 and bf16;
- causal attention at several sequence lengths, forward and backward through
  ``F.scaled_dot_product_attention`` (its efficiency grows with the sequence), counted in the
  FLOPs it executes (the planner's convention: half the scores, backward 2.5× forward);
- memory bandwidth of an elementwise op that reads tensors no longer in cache and allocates its
  output, as a training step's eager ops do;
- the resident memory of a process that has imported torch and accelrun's training stack (what a
  CPU training process carries before it holds any tensor; the data set it reads is not included);
- gloo all-reduce and all-gather between local processes on 127.0.0.1: bus bandwidth and latency.

``devices_per_node`` processes each measure compute at the same time with
``cores // devices_per_node`` threads (as ``accelrun train`` runs that many ranks); with one
device, one process measures with all threads while a second waits, there only for the collectives.
Needs torch; nothing else in ``accelrun.plan`` does.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib
import json
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from accelrun.report.peak import cpu_model_name, default_cache_dir

ATTENTION_BACKWARD_RATIO = 2.5  # as accelrun.plan.efficiency (kept in step by a test)
CALIBRATION_TIMEOUT_S = 300


@dataclass(frozen=True)
class ProbeSizes:
    """What the probes run; ``quick()`` keeps tests to a few seconds."""

    widths: tuple[int, ...] = (64, 128, 256, 512, 1024)
    rows: int = 2048
    precisions: tuple[str, ...] = ("fp32", "bf16")
    # Causal attention at these sequence lengths, batch × sequence = attention_tokens, 4 heads of 64.
    attention_seq: tuple[int, ...] = (128, 256, 512, 1024)
    attention_tokens: int = 2048
    attention_heads: tuple[int, int] = (4, 64)
    # Elementwise probe: tensors of memory_elements, cycled through a pool of memory_pool_bytes in all
    # (larger than a last-level cache), so each op reads cold data as a training step's ops do.
    memory_elements: int = 2**20
    memory_pool_bytes: int = 128 * 2**20
    collective_bytes: int = 16 * 2**20
    small_bytes: int = 4096
    repeat_s: float = 0.04
    repeats: int = 5
    # Imported before the resident memory is read: what a training process holds before any tensor.
    runtime_imports: tuple[str, ...] = ("accelrun.train.run",)

    @classmethod
    def quick(cls) -> ProbeSizes:
        return cls(widths=(32, 64), rows=256, precisions=("fp32",), attention_seq=(32, 64),
                   attention_tokens=128, attention_heads=(2, 16),
                   memory_elements=2**16, memory_pool_bytes=2**20, collective_bytes=2**16, small_bytes=256, repeat_s=0.01, repeats=2,
                   runtime_imports=())


@dataclass
class Measured:
    matmul_tflops: dict[str, dict[int, float]] = field(default_factory=dict)
    attention_tflops: dict[str, dict[int, float]] = field(default_factory=dict)
    memory_bandwidth_gbs: float = 0.0
    runtime_gib: float = 0.0
    threads: int = 1
    all_reduce_gbs: float = 0.0
    all_gather_gbs: float = 0.0
    latency_us: float = 0.0


def calibrate(devices_per_node: int = 1, sizes: ProbeSizes | None = None) -> dict[str, Any]:
    """Measure and return a cluster description (``{"cluster": {...}}``) for this machine."""
    import multiprocessing as mp

    sizes = sizes or ProbeSizes()
    world = max(2, devices_per_node)
    port = _free_port()
    # Not fork: a parent that has already run a parallel torch op would hand its children a broken
    # OpenMP pool (they hang). A fork server imports torch once, fresh, and forks the workers from it;
    # spawn, where there is no fork server, imports torch in each worker.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", *sizes.runtime_imports, __name__])
    else:
        ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, world, devices_per_node, port, sizes, queue))
             for rank in range(world)]
    for p in procs:
        p.start()
    try:
        results = _collect(queue, procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [r for r in results if "error" in r]
    if errors:
        if errors[0].get("user"):
            from accelrun.plan.cluster import PlanError

            raise PlanError(errors[0]["error"])
        raise RuntimeError(f"calibration failed: {errors[0]['error']}")
    by_rank = {r["rank"]: r for r in results}
    return describe(_combine([by_rank[i]["measured"] for i in range(devices_per_node)],
                             by_rank[0]["measured"]), devices_per_node)


def _collect(queue, procs) -> list[dict]:
    """Each worker's result; a worker that dies without one (killed, crashed) fails the calibration
    instead of leaving the parent waiting."""
    import queue as queue_module

    results: list[dict] = []
    deadline = time.monotonic() + CALIBRATION_TIMEOUT_S
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=0.5))
        except queue_module.Empty:
            dead = [p for p in procs if p.exitcode is not None and p.exitcode != 0]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                why = (f"a measuring process exited with code {dead[0].exitcode}" if dead
                       else f"no result within {CALIBRATION_TIMEOUT_S} s")
                raise RuntimeError(f"calibration failed: {why}") from None
    return results


def _combine(computing: list[Measured], rank0: Measured) -> Measured:
    """Ranks that computed at once: the slowest one's rates (a step waits for the slowest rank)."""
    out = Measured(threads=computing[0].threads, runtime_gib=max(m.runtime_gib for m in computing),
                   all_reduce_gbs=rank0.all_reduce_gbs, all_gather_gbs=rank0.all_gather_gbs,
                   latency_us=rank0.latency_us)
    for key in computing[0].matmul_tflops:
        out.matmul_tflops[key] = {w: min(m.matmul_tflops[key][w] for m in computing)
                                  for w in computing[0].matmul_tflops[key]}
        out.attention_tflops[key] = {t: min(m.attention_tflops[key][t] for m in computing)
                                     for t in computing[0].attention_tflops[key]}
    out.memory_bandwidth_gbs = min(m.memory_bandwidth_gbs for m in computing)
    return out


def describe(m: Measured, devices_per_node: int) -> dict[str, Any]:
    host = f"{cpu_model_name()}, {os.cpu_count()} cores"
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    how = f"measured by `accelrun plan --calibrate` on {host} at {when}"
    cluster = {
        "device": "cpu",
        "devices_per_node": devices_per_node,
        "nodes": 1,
        "memory_gib": round(_mem_total_gib() / devices_per_node, 2),
        "intra_node": {"bandwidth_gbs": round(min(m.all_reduce_gbs, m.all_gather_gbs), 4),
                       "latency_us": round(m.latency_us, 1), "measured": True},
        "calibration": {
            "measured_at": when,
            "host": host,
            "torch": _torch_version(),
            "threads_per_device": m.threads,
            # YAML recipes take string keys only: widths and sequence lengths are written as strings.
            "matmul_tflops": {k: {str(w): round(r, 6) for w, r in v.items()} for k, v in m.matmul_tflops.items()},
            "attention_tflops": {k: {str(t): round(r, 6) for t, r in v.items()}
                                 for k, v in m.attention_tflops.items()},
            "memory_bandwidth_gbs": round(m.memory_bandwidth_gbs, 3),
            "runtime_gib": round(m.runtime_gib, 3),
        },
        "sources": {
            "memory_gib": "MemTotal in /proc/meminfo, divided among the devices",
            "intra_node": (f"{how}: gloo bus bandwidth, all-reduce {m.all_reduce_gbs:.3g} GB/s, "
                           f"all-gather {m.all_gather_gbs:.3g} GB/s (the lower is used)"),
            "calibration": how,
        },
    }
    return {"cluster": cluster}


def to_yaml(description: dict[str, Any]) -> str:
    c = description["cluster"]
    head = (f"# This machine ({c['calibration']['host']}) as {c['devices_per_node']} device(s), measured by\n"
            f"# `accelrun plan --calibrate` at {c['calibration']['measured_at']}. Use: --cluster THIS_FILE\n")
    return head + yaml.safe_dump(description, sort_keys=False, default_flow_style=None, width=110)


def cache_path(devices_per_node: int, cache_dir: Path | None = None) -> Path:
    """Where this machine's calibration for ``devices_per_node`` is kept (torch-free to compute)."""
    key = {"cpu": cpu_model_name(), "cores": os.cpu_count(), "torch": _torch_version(),
           "devices_per_node": devices_per_node}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / "plan" / f"cpu-{digest}.yaml"


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 2**30
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- in each spawned process -------------------------------------------------------------------

def _worker(rank: int, world: int, devices: int, port: int, sizes: ProbeSizes, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            queue.put({"rank": rank, "user": True, "error": (
                "this machine has CUDA GPUs; --calibrate measures CPUs with gloo only in this version (NCCL and "
                "GPU probes are not built yet). Describe the GPUs instead: a cluster file naming a kind from "
                "`accelrun plan --devices` (see recipes/cluster/h100-8x.yaml)")})
            return
        for module in sizes.runtime_imports:  # what a training process holds before any tensor
            importlib.import_module(module)
        runtime = _rss_gib()
        computes = rank < devices
        threads = torch.get_num_threads() if devices == 1 else max(1, (os.cpu_count() or 1) // devices)
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        m = Measured(threads=threads, runtime_gib=runtime)
        dist.barrier()
        if computes:  # the ranks that are devices measure at the same time
            for key in sizes.precisions:
                dtype = torch.float32 if key == "fp32" else torch.bfloat16
                m.matmul_tflops[key] = {w: _matmul_rate(torch, dtype, sizes.rows, w, sizes) for w in sizes.widths}
                m.attention_tflops[key] = {t: _attention_rate(torch, dtype, t, sizes) for t in sizes.attention_seq}
            m.memory_bandwidth_gbs = _memory_rate(torch, sizes)
        dist.barrier()
        m.all_reduce_gbs, m.all_gather_gbs, m.latency_us = _collective_rates(torch, dist, world, sizes)
        dist.destroy_process_group()
        queue.put({"rank": rank, "measured": m})
    except Exception as e:  # reported by the parent, which owns the terminal
        queue.put({"rank": rank, "error": f"rank {rank}: {type(e).__name__}: {e}"})


def _typical_rate(fn, work: float, sizes: ProbeSizes) -> float:
    """Median over ``sizes.repeats`` timings of ``fn`` (each looped for about ``repeat_s``): work/second.

    The median, not the best: the planner predicts a run's median step, which meets the machine as
    it usually is, not at its best moment.
    """
    fn()  # warm-up: allocation, kernel selection
    rates = []
    for _ in range(sizes.repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= sizes.repeat_s:
                break
        rates.append(work * n / elapsed)
    return statistics.median(rates)


def _matmul_rate(torch, dtype, rows: int, width: int, sizes: ProbeSizes) -> float:
    x = torch.randn(rows, width).to(dtype)
    wt = torch.randn(width, width).to(dtype)
    dy = torch.randn(rows, width).to(dtype)
    flops = 2.0 * rows * width * width
    # A step's matmuls run in three layouts; time each and combine as one pass through all three.
    times = [flops / _typical_rate(fn, flops, sizes) for fn in (lambda: x @ wt, lambda: dy @ wt.t(),
                                                            lambda: x.t() @ dy)]
    return 3 * flops / sum(times) / 1e12


def _attention_rate(torch, dtype, t: int, sizes: ProbeSizes) -> float:
    import torch.nn.functional as F

    b, (h, e) = max(1, sizes.attention_tokens // t), sizes.attention_heads
    q, k, v = (torch.randn(b, h, t, e, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, t, e, dtype=dtype)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    forward = 2.0 * b * h * t * t * e  # causal: half of Q·Kᵀ and of P·V, 2·t·t·e each
    work = forward * (1 + ATTENTION_BACKWARD_RATIO)
    return _typical_rate(step, work, sizes) / 1e12


def _memory_rate(torch, sizes: ProbeSizes) -> float:
    n = sizes.memory_elements
    pool = [torch.randn(n) for _ in range(max(2, sizes.memory_pool_bytes // (4 * n)))]
    turn = [0]

    def op() -> None:  # the next two tensors of the pool, into a fresh output, as eager ops allocate
        i = turn[0] = (turn[0] + 2) % len(pool)
        torch.mul(pool[i], pool[i - 1])

    return _typical_rate(op, 3.0 * 4 * n, sizes) / 1e9  # read two, write one


def _collective_rates(torch, dist, world: int, sizes: ProbeSizes) -> tuple[float, float, float]:
    n = world
    big = torch.ones(sizes.collective_bytes // 4)
    shard = torch.ones(sizes.collective_bytes // 4 // n)
    gathered = torch.empty(shard.numel() * n)
    small = torch.ones(max(1, sizes.small_bytes // 4))

    def timed(fn) -> float:
        fn()  # warm-up: connections, buffers
        times = []
        for _ in range(sizes.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    ar = timed(lambda: dist.all_reduce(big))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    ag = timed(lambda: gather(gathered, shard))
    tiny = timed(lambda: dist.all_reduce(small))
    ar_bus = big.numel() * 4 / ar * 2 * (n - 1) / n / 1e9
    ag_bus = gathered.numel() * 4 / ag * (n - 1) / n / 1e9
    return ar_bus, ag_bus, tiny / (2 * (n - 1)) * 1e6  # a ring all-reduce is 2(n-1) hops


def _rss_gib() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return 0.0


def with_cached_calibration(c):
    """``c`` (a ``cpu`` ClusterConfig with no measurements) completed from this machine's cache.

    ``accelrun plan --calibrate`` fills the cache; ``cluster/cpu-local`` relies on it. Torch-free.
    """
    from accelrun.config.schema import ClusterConfig
    from accelrun.plan.cluster import PlanError

    path = cache_path(c.devices_per_node)
    try:
        cached = ClusterConfig.model_validate(yaml.safe_load(path.read_text(encoding="utf-8"))["cluster"])
    except FileNotFoundError:
        raise PlanError(
            f"cluster.device = cpu with cluster.devices_per_node = {c.devices_per_node}: this machine has not "
            f"been measured yet; run `accelrun plan --calibrate --devices-per-node {c.devices_per_node}` "
            f"(a few seconds; kept in {path})"
        ) from None
    except Exception as e:  # a damaged cache file: say where it is
        raise PlanError(f"cannot read the calibration cache {path}: {e}; run `accelrun plan --calibrate` "
                        "again") from None
    update: dict[str, Any] = {"calibration": cached.calibration, "sources": {**cached.sources, **c.sources}}
    if c.memory_gib is None:
        update["memory_gib"] = cached.memory_gib
    if c.intra_node.bandwidth_gbs is None:
        update["intra_node"] = cached.intra_node
    update["sources"]["calibration"] = f"{cached.sources.get('calibration', 'measured')} (cache {path})"
    return c.model_copy(update=update)

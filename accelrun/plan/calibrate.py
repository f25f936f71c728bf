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
- gloo all-reduce and all-gather between local processes on 127.0.0.1: bus bandwidth and latency
  between barriers; and all-gather, reduce-scatter and all-reduce each fitted to two message sizes
  timed right after a burst of compute (as FSDP meets them), which the planner uses for them;
- attention again at several head dimensions (same total width) to scale the curve to a model's.

``devices_per_node`` processes each measure compute at the same time with
``cores // devices_per_node`` threads (as ``accelrun train`` runs that many ranks); with one
device, one process measures with all threads while a second waits, there only for the collectives.

On a machine with CUDA GPUs the same probes run on the GPUs at larger sizes (``ProbeSizes.for_gpu``),
timed to the end of their kernels, with NCCL for the collectives between them (none for one GPU,
whose link stays the accelerator table's); the description names the matching accelerator kind, so
MFU still divides by its datasheet peak.
The probes themselves are in ``accelrun.plan.probes``; they need torch, nothing else in ``accelrun.plan``
does (this module imports it to count GPUs and in the processes it starts).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from accelrun.plan.errors import PlanError
from accelrun.plan.probes import Measured, ProbeSizes, measure_worker
from accelrun.report.peak import cpu_model_name, default_cache_dir

CALIBRATION_TIMEOUT_S = 300


def calibrate(devices_per_node: int = 1, sizes: ProbeSizes | None = None) -> dict[str, Any]:
    """Measure and return a cluster description (``{"cluster": {...}}``) for this machine."""
    import multiprocessing as mp

    gpus = _cuda_device_count()
    sizes = sizes or (ProbeSizes.for_gpu() if gpus else ProbeSizes())
    # GPUs: NCCL between them, none for a single one. CPU: a second process for the gloo
    # collectives even when one device computes.
    world = devices_per_node if gpus else max(2, devices_per_node)
    port = _free_port()
    # Not fork: a parent that has already run a parallel torch op would hand its children a broken
    # OpenMP pool (they hang). A fork server imports torch once, fresh, and forks the workers from it;
    # spawn, where there is no fork server, imports torch in each worker.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "accelrun.plan.probes", __name__])
    else:
        ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=measure_worker, args=(rank, world, devices_per_node, port, sizes, queue))
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
            raise PlanError(errors[0]["error"])
        raise RuntimeError(f"calibration failed: {errors[0]['error']}")
    by_rank = {r["rank"]: r for r in results}
    measured = _combine([by_rank[i]["measured"] for i in range(devices_per_node)], by_rank[0]["measured"])
    if sizes.runtime_imports:  # after the probes, so as not to disturb them
        measured.runtime_gib = _fresh_process_rss_gib(sizes.runtime_imports)
    return describe(measured, devices_per_node, sizes)


def _fresh_process_rss_gib(modules: tuple[str, ...]) -> float:
    """Resident memory of a new interpreter that imported ``modules`` (a forked worker would share, and
    not count, pages its parent had loaded)."""
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "print(open('/proc/self/statm').read().split()[1])")
    done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=300)
    try:
        return int(done.stdout.split()[-1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, IndexError):
        return 0.0


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
                   latency_us=rank0.latency_us, collectives=rank0.collectives, device_name=rank0.device_name,
                   device_memory_gib=min(m.device_memory_gib for m in computing))

    def slowest(field: str, key: str) -> dict[int, float]:
        first = getattr(computing[0], field)[key]
        return {x: min(getattr(m, field)[key][x] for m in computing) for x in first}

    for key in computing[0].matmul_tflops:
        out.matmul_tflops[key] = slowest("matmul_tflops", key)
        out.attention_tflops[key] = slowest("attention_tflops", key)
        if key in computing[0].attention_head_dim_tflops:
            out.attention_head_dim_tflops[key] = slowest("attention_head_dim_tflops", key)
    out.memory_bandwidth_gbs = min(m.memory_bandwidth_gbs for m in computing)
    return out


def describe(m: Measured, devices_per_node: int, sizes: ProbeSizes | None = None) -> dict[str, Any]:
    sizes = sizes or ProbeSizes()
    gpu = m.device_name
    host = f"{cpu_model_name()}, {os.cpu_count()} cores"
    if gpu:
        host = f"{devices_per_node} × {gpu} on {host}"
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    how = f"measured by `accelrun plan --calibrate` on {host} at {when}"
    kind, kind_note = accelerator_kind(gpu) if gpu else ("cpu", "")
    cluster: dict[str, Any] = {
        "device": kind,
        "devices_per_node": devices_per_node,
        "nodes": 1,
        "memory_gib": round(m.device_memory_gib if gpu else _mem_total_gib() / devices_per_node, 2),
    }
    if m.collectives:  # none for a single GPU: the accelerator table's link stands
        cluster["intra_node"] = {
            "bandwidth_gbs": round(min(m.all_reduce_gbs, m.all_gather_gbs), 4),
            "latency_us": round(m.latency_us, 1), "measured": True,
            "collectives": {k: {"bandwidth_gbs": round(bw, 4), "latency_us": round(lat, 1)}
                            for k, (bw, lat) in m.collectives.items()}}
    library = "NCCL" if gpu else "gloo"
    cluster.update({
        "calibration": {
            "measured_at": when,
            "host": host,
            "device_name": gpu,
            "torch": _torch_version(),
            "threads_per_device": m.threads,
            # YAML recipes take string keys only: widths and sequence lengths are written as strings.
            "matmul_tflops": {k: {str(w): round(r, 6) for w, r in v.items()} for k, v in m.matmul_tflops.items()},
            "attention_tflops": {k: {str(t): round(r, 6) for t, r in v.items()}
                                 for k, v in m.attention_tflops.items()},
            "attention_head_dim": sizes.attention_heads[1],
            "attention_head_dim_tflops": {k: {str(e): round(r, 6) for e, r in v.items()}
                                          for k, v in m.attention_head_dim_tflops.items()},
            "attention_head_dim_seq": sizes.attention_head_dim_seq,
            "memory_bandwidth_gbs": round(m.memory_bandwidth_gbs, 3),
            "runtime_gib": None if gpu else round(m.runtime_gib, 3),
        },
        "sources": {
            "memory_gib": ("CUDA device properties (total memory)" if gpu
                           else "MemTotal in /proc/meminfo, divided among the devices"),
            "calibration": how + kind_note,
        },
    })
    if m.collectives:
        cluster["sources"]["intra_node"] = (
            f"{how}: {library} bus bandwidth between barriers, all-reduce {m.all_reduce_gbs:.3g} GB/s, "
            f"all-gather {m.all_gather_gbs:.3g} GB/s (the lower is the link's); per collective, fitted to "
            f"{sizes.block_bytes / 2**20:g} and {sizes.collective_bytes / 2**20:g} MiB messages timed right after "
            "compute")
    return {"cluster": cluster}


def accelerator_kind(device_name: str) -> tuple[str, str]:
    """The accelerator kind a GPU's CUDA name matches (its datasheet peak is what MFU divides by),
    or ``custom``; and a note saying how it was chosen."""
    from accelrun.plan.accelerators import ACCELERATORS
    from accelrun.report.gpu_table import find_gpu_entry

    entry = find_gpu_entry(device_name)
    kinds = [a.kind for a in ACCELERATORS if entry is not None and a.peak_entry == entry.entry]
    if not kinds:
        return "custom", f"; {device_name!r} matches no accelerator kind: device custom, MFU against the best rate"
    note = f"; {device_name!r} taken as {kinds[0]}"
    if len(kinds) > 1:
        note += f" (also possible: {', '.join(kinds[1:])}; set cluster.device if it is one of those)"
    return kinds[0], note


def to_yaml(description: dict[str, Any]) -> str:
    c = description["cluster"]
    head = (f"# This machine ({c['calibration']['host']}) as {c['devices_per_node']} device(s), measured by\n"
            f"# `accelrun plan --calibrate` at {c['calibration']['measured_at']}. Use: --cluster THIS_FILE\n")
    return head + yaml.safe_dump(description, sort_keys=False, default_flow_style=None, width=110)


def cache_path(devices_per_node: int, cache_dir: Path | None = None, gpu: str | None = None) -> Path:
    """Where this machine's calibration for ``devices_per_node`` is kept (torch-free to compute);
    a GPU calibration apart from the CPU's (``cluster/cpu-local`` reads the CPU's)."""
    key = {"cpu": cpu_model_name(), "cores": os.cpu_count(), "torch": _torch_version(),
           "devices_per_node": devices_per_node}
    if gpu:
        key["gpu"] = gpu
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / "plan" / f"{'gpu' if gpu else 'cpu'}-{digest}.yaml"


def _cuda_device_count() -> int:
    import torch  # the parent only asks; the measuring processes come from a fresh fork server

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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


def with_cached_calibration(c, processes_per_node: int | None = None):
    """``c`` (a ``cpu`` ClusterConfig with no measurements) completed from this machine's cache.

    ``accelrun plan --calibrate`` fills the cache; ``cluster/cpu-local`` relies on it. Torch-free.
    ``processes_per_node``: the recipe's; more than ``c``'s devices, the hint measures that many.
    """
    from accelrun.config.schema import ClusterConfig
    path = cache_path(c.devices_per_node)
    try:
        cached = ClusterConfig.model_validate(yaml.safe_load(path.read_text(encoding="utf-8"))["cluster"])
    except FileNotFoundError:
        n = c.devices_per_node
        then = ""
        if processes_per_node is not None and processes_per_node > n:
            # (a trial's 2-rank recipe was told to measure 1 device, and then that 2 processes do not fit it)
            n = processes_per_node
            then = f", then plan with cluster.devices_per_node={n} (the recipe runs {n} processes a node)"
        raise PlanError(
            f"cluster.device = cpu with cluster.devices_per_node = {c.devices_per_node}: this machine has not "
            f"been measured yet; run `accelrun plan --calibrate --devices-per-node {n}` "
            f"(about a minute; kept in {cache_path(n)}){then}"
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

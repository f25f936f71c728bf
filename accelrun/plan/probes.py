"""The measurements behind ``accelrun plan --calibrate``, run in each measuring process.

See ``accelrun.plan.calibrate`` for what is measured and why; this module holds the probes
themselves (they need torch, imported by the process that runs them).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

ATTENTION_BACKWARD_RATIO = 2.5  # as accelrun.plan.efficiency (kept in step by a test)


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


def measure_worker(rank: int, world: int, devices: int, port: int, sizes: ProbeSizes, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            queue.put({"rank": rank, "user": True, "error": (
                "this machine has CUDA GPUs; --calibrate measures CPUs with gloo only in this version (NCCL and "
                "GPU probes are not built yet). Describe the GPUs instead: a cluster file naming a kind from "
                "`accelrun plan --devices` (see recipes/cluster/h100-8x.yaml)")})
            return
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

"""The measurements behind ``accelrun plan --calibrate``, run in each measuring process.

See ``accelrun.plan.calibrate`` for what is measured and why; this module holds the probes
themselves (they need torch, imported by the process that runs them).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
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
    # The same at head dimensions of the same total width (heads × head dim), at attention_head_dim_seq.
    attention_head_dims: tuple[int, ...] = (32, 64, 128)
    attention_head_dim_seq: int = 256
    # Elementwise probe: tensors of memory_elements, cycled through a pool of memory_pool_bytes in all
    # (larger than a last-level cache), so each op reads cold data as a training step's ops do.
    memory_elements: int = 2**20
    memory_pool_bytes: int = 128 * 2**20
    collective_bytes: int = 16 * 2**20
    # Collectives are also timed at a block-sized message, each right after burst_s of compute on
    # every rank, burst_repeats times.
    block_bytes: int = 2**20
    burst_s: float = 0.03
    burst_repeats: int = 10
    small_bytes: int = 4096
    repeat_s: float = 0.08
    repeats: int = 5
    # Imported before the resident memory is read: what a training process holds before any tensor.
    runtime_imports: tuple[str, ...] = ("accelrun.train.run",)

    @classmethod
    def for_gpu(cls) -> ProbeSizes:
        """Sizes at which a GPU shows its rate rather than its launch latency."""
        return cls(widths=(1024, 2048, 4096, 8192), rows=16384, attention_seq=(512, 1024, 2048, 4096, 8192),
                   attention_tokens=32768, attention_heads=(16, 128), attention_head_dims=(64, 128, 256),
                   attention_head_dim_seq=2048, memory_elements=2**26, memory_pool_bytes=2**31,
                   collective_bytes=256 * 2**20, block_bytes=16 * 2**20, runtime_imports=())

    @classmethod
    def quick(cls) -> ProbeSizes:
        return cls(widths=(32, 64), rows=256, precisions=("fp32",), attention_seq=(32, 64),
                   attention_tokens=128, attention_heads=(2, 16), attention_head_dims=(8, 16),
                   attention_head_dim_seq=32, memory_elements=2**16, memory_pool_bytes=2**20,
                   collective_bytes=2**16, block_bytes=2**12, burst_s=0.002, burst_repeats=2, small_bytes=256, repeat_s=0.01,
                   repeats=2, runtime_imports=())


@dataclass
class Measured:
    matmul_tflops: dict[str, dict[int, float]] = field(default_factory=dict)
    attention_tflops: dict[str, dict[int, float]] = field(default_factory=dict)
    attention_head_dim_tflops: dict[str, dict[int, float]] = field(default_factory=dict)
    memory_bandwidth_gbs: float = 0.0
    runtime_gib: float = 0.0
    threads: int = 1
    all_reduce_gbs: float = 0.0
    all_gather_gbs: float = 0.0
    latency_us: float = 0.0
    # collective → (bus GB/s, per-hop latency µs) as a training step meets it (``_collective_fits``)
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)
    device_name: str | None = None  # a GPU's, as CUDA names it; None on a CPU
    device_memory_gib: float = 0.0


def _gpu_name_and_memory(torch, index: int) -> tuple[str, float]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.total_memory / 2**30


def measure_worker(rank: int, world: int, devices: int, port: int, sizes: ProbeSizes, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        gpu = torch.cuda.is_available()
        if gpu:
            if torch.cuda.device_count() < devices:
                queue.put({"rank": rank, "user": True, "error": (
                    f"--devices-per-node {devices}, but this machine has {torch.cuda.device_count()} GPU(s)")})
                return
            torch.cuda.set_device(rank)
            torch.set_default_device(f"cuda:{rank}")  # every probe tensor on this rank's GPU
        runtime = 0.0 if gpu else _rss_gib()
        computes = rank < devices
        threads = torch.get_num_threads() if devices == 1 else max(1, (os.cpu_count() or 1) // devices)
        torch.set_num_threads(threads)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        m = Measured(threads=threads, runtime_gib=runtime)
        if gpu:
            m.device_name, m.device_memory_gib = _gpu_name_and_memory(torch, rank)
        dist.barrier()
        finish = torch.cuda.synchronize if gpu else None  # GPU work is timed to its end
        if computes:  # the ranks that are devices measure at the same time
            _measure_compute(torch, m, sizes, sync=dist.barrier if devices > 1 else None, finish=finish)
        if world > 1:  # one GPU alone has no collective to measure
            dist.barrier()
            m.all_reduce_gbs, m.all_gather_gbs, m.latency_us = _collective_rates(torch, dist, world, sizes, finish)
            m.collectives = _collective_fits(torch, dist, world, sizes, finish, m.latency_us)
        dist.destroy_process_group()
        queue.put({"rank": rank, "measured": m})
    except Exception as e:  # reported by the parent, which owns the terminal
        queue.put({"rank": rank, "error": f"rank {rank}: {type(e).__name__}: {e}"})


@dataclass
class _Probe:
    """One timed loop: ``fn`` does ``work`` (FLOPs or bytes) per call; rates collects work per second."""

    fn: Callable[[], object]
    work: float
    rates: list[float] = field(default_factory=list)

    def sample(self, seconds: float, finish: Callable[[], object] | None = None) -> None:
        if finish:
            finish()
        n, t0 = 0, time.perf_counter()
        while True:
            self.fn()
            if finish:
                finish()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
        self.rates.append(self.work * n / elapsed)

    @property
    def typical(self) -> float:
        return statistics.median(self.rates)


def _measure_compute(torch, m: Measured, sizes: ProbeSizes, sync: Callable[[], object] | None = None,
                     finish: Callable[[], object] | None = None) -> None:
    """Every compute probe, in ``sizes.repeats`` interleaved rounds, each probe's median rate.

    Rounds, not one probe's repeats back to back: a shared machine has slow spells of seconds, which
    should cost each probe one sample, not some probes all of theirs. The median, not the best: the
    planner predicts a run's median step, which meets the machine as it usually is. ``sync`` (a
    barrier of the computing ranks) starts every sample on all of them at once: ranks that share a
    machine are slower together than one alone, and they train together. ``finish`` waits for a
    GPU's queued work, so that a sample times the kernels, not their launches.
    """
    matmuls: dict[tuple[str, int], list[_Probe]] = {}
    attention: dict[tuple[str, int, int], _Probe] = {}
    for key in sizes.precisions:
        dtype = torch.float32 if key == "fp32" else torch.bfloat16
        for w in sizes.widths:
            matmuls[key, w] = _matmul_probes(torch, dtype, sizes.rows, w)
        heads, head_dim = sizes.attention_heads
        for t in sizes.attention_seq:
            attention[key, t, head_dim] = _attention_probe(torch, dtype, t, heads, head_dim, sizes)
        for e in sizes.attention_head_dims:
            if (key, sizes.attention_head_dim_seq, e) not in attention:
                attention[key, sizes.attention_head_dim_seq, e] = _attention_probe(
                    torch, dtype, sizes.attention_head_dim_seq, max(1, heads * head_dim // e), e, sizes)
    memory = _memory_probe(torch, sizes)
    probes = [p for ps in matmuls.values() for p in ps] + list(attention.values()) + [memory]
    for p in probes:
        p.fn()  # warm-up: allocation, kernel selection
    for _ in range(sizes.repeats):
        for p in probes:
            if sync is not None:
                sync()
            p.sample(sizes.repeat_s, finish)

    heads, head_dim = sizes.attention_heads
    for key in sizes.precisions:
        # A step's matmuls run in three layouts: combined as one pass through all three.
        m.matmul_tflops[key] = {w: len(ps) * ps[0].work / sum(p.work / p.typical for p in ps) / 1e12
                                for (k, w), ps in matmuls.items() if k == key}
        m.attention_tflops[key] = {t: attention[key, t, head_dim].typical / 1e12 for t in sizes.attention_seq}
        m.attention_head_dim_tflops[key] = {
            e: attention[key, sizes.attention_head_dim_seq, e].typical / 1e12 for e in sizes.attention_head_dims}
    m.memory_bandwidth_gbs = memory.typical / 1e9


def _matmul_probes(torch, dtype, rows: int, width: int) -> list[_Probe]:
    """Forward ``X·W``, input gradient ``dY·Wᵀ`` and weight gradient ``Xᵀ·dY`` at one width."""
    x = torch.randn(rows, width).to(dtype)
    wt = torch.randn(width, width).to(dtype)
    dy = torch.randn(rows, width).to(dtype)
    flops = 2.0 * rows * width * width
    return [_Probe(fn, flops) for fn in (lambda: x @ wt, lambda: dy @ wt.t(), lambda: x.t() @ dy)]


def _attention_probe(torch, dtype, t: int, h: int, e: int, sizes: ProbeSizes) -> _Probe:
    import torch.nn.functional as F

    b = max(1, sizes.attention_tokens // t)
    q, k, v = (torch.randn(b, h, t, e, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, t, e, dtype=dtype)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    forward = 2.0 * b * h * t * t * e  # causal: half of Q·Kᵀ and of P·V, 2·t·t·e each
    return _Probe(step, forward * (1 + ATTENTION_BACKWARD_RATIO))


def _memory_probe(torch, sizes: ProbeSizes) -> _Probe:
    n = sizes.memory_elements
    pool = [torch.randn(n) for _ in range(max(2, sizes.memory_pool_bytes // (4 * n)))]
    turn = [0]

    def op() -> None:  # the next two tensors of the pool, into a fresh output, as eager ops allocate
        i = turn[0] = (turn[0] + 2) % len(pool)
        torch.mul(pool[i], pool[i - 1])

    return _Probe(op, 3.0 * 4 * n)  # bytes: read two, write one


def _collective_time(dist, fn, repeats: int, finish: Callable[[], object] | None,
                     before: Callable[[], object] | None = None) -> float:
    """Median seconds of the collective ``fn`` on this rank, started together behind a barrier
    (then ``before``, where given); on a GPU timed to its end, as NCCL calls return once queued."""

    def call() -> None:
        fn()
        if finish:
            finish()

    call()  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        dist.barrier()
        if before:
            before()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gather_and_scatter(dist):
    """all-gather and reduce-scatter into/out of one flat tensor (renamed ``*_single`` in torch 2.13)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return gather, scatter


def _collective_rates(torch, dist, world: int, sizes: ProbeSizes,
                      finish: Callable[[], object] | None = None) -> tuple[float, float, float]:
    n = world
    big = torch.ones(sizes.collective_bytes // 4)
    shard = torch.ones(sizes.collective_bytes // 4 // n)
    gathered = torch.empty(shard.numel() * n)
    small = torch.ones(max(1, sizes.small_bytes // 4))
    gather, _ = _gather_and_scatter(dist)

    ar = _collective_time(dist, lambda: dist.all_reduce(big), sizes.repeats, finish)
    ag = _collective_time(dist, lambda: gather(gathered, shard), sizes.repeats, finish)
    tiny = _collective_time(dist, lambda: dist.all_reduce(small), sizes.repeats, finish)
    ar_bus = big.numel() * 4 / ar * 2 * (n - 1) / n / 1e9
    ag_bus = gathered.numel() * 4 / ag * (n - 1) / n / 1e9
    return ar_bus, ag_bus, tiny / (2 * (n - 1)) * 1e6  # a ring all-reduce is 2(n-1) hops


RING_HOPS = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}  # × (n - 1): hops, and bytes × (n-1)/n


def _collective_fits(torch, dist, world: int, sizes: ProbeSizes, finish: Callable[[], object] | None = None,
                     tiny_us: float = 0.0) -> dict[str, tuple[float, float]]:
    """Bus bandwidth (GB/s) and per-hop latency (µs) of each collective, fitted to two message sizes.

    Each is timed right after a burst of matmuls on every rank, as a training step meets it: FSDP's
    collectives come between blocks of compute, which leave the buffers out of cache and the
    communication threads asleep; on a quiet barrier they look several times cheaper. The bursts end
    at the same moment on every rank, so this does not include waiting for a rank that computed
    slower (a step's does: see the planner's notes). gloo's reduce-scatter is slower than its
    all-gather, so each is fitted on its own.
    """
    n = world
    a, b = torch.randn(512, 256), torch.randn(256, 256)

    def burst() -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < sizes.burst_s:
            a @ b
        if finish:
            finish()

    gather, scatter = _gather_and_scatter(dist)
    fits = {}
    for name in RING_HOPS:
        points = []
        for size in (sizes.block_bytes, sizes.collective_bytes):
            full = torch.ones(size // 4 // n * n)
            shard = torch.ones(full.numel() // n)
            fn = {"all_gather": lambda f=full, s=shard: gather(f, s),
                  "reduce_scatter": lambda f=full, s=shard: scatter(s, f),
                  "all_reduce": lambda f=full: dist.all_reduce(f)}[name]
            points.append((full.numel() * 4, _collective_time(dist, fn, sizes.burst_repeats, finish, burst)))
        fits[name] = fit_alpha_beta(points, RING_HOPS[name], n, tiny_us)
    return fits


def fit_alpha_beta(points: list[tuple[float, float]], hops: int, n: int, measured_us: float = 0.0,
                   ) -> tuple[float, float]:
    """(bus GB/s, per-hop µs) from two (full message bytes, seconds) points of a ring collective.

    Model: t = hops·(n-1)·latency + hops·(n-1)/n · bytes / bandwidth. Timings too noisy to give a
    positive slope fall back to the larger message's rate; a fit with no positive latency takes
    ``measured_us``, a tiny message's per-hop time (a 2-process fit said 0 µs: a trial's).
    """
    (s1, t1), (s2, t2) = sorted(points)
    moved = hops * (n - 1) / n
    if t2 > t1 and s2 > s1:
        bandwidth = moved * (s2 - s1) / (t2 - t1)
        latency = max(0.0, t1 - moved * s1 / bandwidth) / (hops * (n - 1))
    else:
        bandwidth, latency = moved * s2 / t2, 0.0
    return bandwidth / 1e9, latency * 1e6 if latency > 0 else measured_us


def _rss_gib() -> float:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return 0.0

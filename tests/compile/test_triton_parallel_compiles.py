"""Triton compiles side by side (``triton_aot.parallel_compiles``): a region's launches at warm-up, and a
tuning's candidates before they are timed. On an H200 a cold first step of the 8-layer Llama took 47.5 s
against Inductor's 10.6, most of it tuning's compiles one after another.

No GPU here, so the kernels are fakes that hand their compile to Triton's asynchronous mode exactly as
``triton.jit`` does (``test_torch_private.test_TritonAsyncCompileMode`` holds Triton to that protocol),
and a barrier proves two compiles were in flight at once (a serial run would break it), with no timing."""

from __future__ import annotations

import importlib.util
import inspect
import threading
from types import SimpleNamespace

import pytest

from accelrun.compile.codegen import launch_tuning, triton_aot
from accelrun.compile.codegen.launch_tuning import candidates, tune
from accelrun.compile.codegen.triton import Launch, launches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


class JitLikeKernel:
    """``warmup`` as ``triton.jit`` does it: a cache per function; on a miss under an active asynchronous
    mode the compile goes to the mode (deduplicated by ``compile_key``, which two functions may share)
    and, from Triton 3.7 on, a placeholder goes in the cache, replaced by the kernel when the mode
    finishes it and removed when it fails (3.6 puts nothing there until it is finished); otherwise it
    compiles here. Each compile may wait at ``barrier`` (two must
    run at once: a serial run breaks it) and is logged with its thread, as is each binary's load."""

    def __init__(self, name: str, log: list, barrier: threading.Barrier | None = None, fails: str | None = None,
                 compile_key: str | None = None) -> None:  # fmt: skip
        self.name, self.log, self.barrier, self.fails = name, log, barrier, fails
        self.compile_key = compile_key or name
        self.device_caches = {0: ({}, {}, None, None, None)}

    def _build(self, options):
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        self.log.append(("compile", self.name, threading.current_thread().name, options))
        if self.fails is not None:
            raise RuntimeError(self.fails)
        return SimpleNamespace(n_regs=32, n_spills=0, _init_handles=lambda: self.log.append(
            ("load", self.name, threading.current_thread().name)))

    def warmup(self, *args, grid, **options):
        from triton.runtime import _async_compile

        cache = self.device_caches[0][0]
        key = tuple(sorted(options.items()))
        if key in cache:
            return cache[key]
        mode = _async_compile.active_mode.get()
        if mode is None:
            cache[key] = kernel = self._build(options)
            return kernel

        def cleanup(future_kernel):
            if cache.get(key) is future_kernel:
                del cache[key]

        finish = lambda built: cache.__setitem__(key, built)  # noqa: E731
        if len(inspect.signature(mode.submit).parameters) == 3:  # Triton 3.6: no placeholder in the cache
            return mode.submit((self.compile_key, key), lambda: self._build(options), finish)
        kernel = mode.submit((self.compile_key, key), lambda: self._build(options), finish, cleanup)
        cache[key] = kernel
        return kernel


def compiles(log: list) -> list:
    return [e for e in log if e[0] == "compile"]


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(triton_aot, "usable_cores", lambda: 4)


def test_compile_threads_one_a_compile_up_to_the_cpus_and_the_cap(monkeypatch):
    monkeypatch.setattr(triton_aot, "usable_cores", lambda: 64)
    assert [triton_aot.compile_threads(n) for n in (0, 1, 3, 40)] == [1, 1, 3, triton_aot.MAX_COMPILE_THREADS]
    monkeypatch.setattr(triton_aot, "usable_cores", lambda: 1)
    assert triton_aot.compile_threads(8) == 1


def _module(tmp_path, name: str, **kernels):
    return SimpleNamespace(__file__=str(tmp_path / f"accelrun_{name}.py"), **kernels)


def _plan(*kernels: str) -> list[Launch]:
    return [Launch(k, (4,), ("x",), block_r=1, block_n=16, num_warps=4 * (i + 1)) for i, k in enumerate(kernels)]


@pytest.fixture
def dtypes(monkeypatch):
    monkeypatch.setattr(triton_aot, "buffer_dtypes", lambda program: {"x": "fp32"})


def test_warm_up_builds_a_regions_launches_together_then_loads_them_here(tmp_path, four_cpus, dtypes):
    log: list = []
    barrier = threading.Barrier(2)
    module = _module(tmp_path, "abc", k0=JitLikeKernel("k0", log, barrier), k1=JitLikeKernel("k1", log, barrier))
    lines = triton_aot.warm_up(program=None, module=module, plan=_plan("k0", "k1"))
    assert lines == ["k0: 32 registers, 0 spills, 4 warps", "k1: 32 registers, 0 spills, 8 warps"]
    # Each kernel compiled once, on the pool; then each binary loaded in this thread, in order.
    assert sorted(e[1] for e in compiles(log)) == ["k0", "k1"]
    assert all(e[2].startswith("accelrun-triton-compile") for e in compiles(log))
    main = threading.current_thread().name
    assert log[2:] == [("load", "k0", main), ("load", "k1", main)]


def test_warm_up_compiles_in_this_thread_with_one_cpu(tmp_path, monkeypatch, dtypes):
    monkeypatch.setattr(triton_aot, "usable_cores", lambda: 1)
    log: list = []
    module = _module(tmp_path, "abc", k0=JitLikeKernel("k0", log), k1=JitLikeKernel("k1", log))
    triton_aot.warm_up(program=None, module=module, plan=_plan("k0", "k1"))
    assert {e[2] for e in log} == {threading.current_thread().name} and len(compiles(log)) == 2


def test_a_failed_compile_raises_from_the_warm_up_for_the_first_failing_launch(tmp_path, four_cpus, dtypes):
    """Both launches fail on the pool, in whatever order they finish; the warm-up then compiles them again
    in order, here, and raises what the first one's compiler said, as a serial warm-up did."""
    log: list = []
    module = _module(tmp_path, "abc", k0=JitLikeKernel("k0", log), k1=JitLikeKernel("k1", log, fails="no k1"),
                     k2=JitLikeKernel("k2", log, fails="no k2"))  # fmt: skip
    with pytest.raises(RuntimeError, match="no k1"):
        triton_aot.warm_up(program=None, module=module, plan=_plan("k0", "k1", "k2"))
    main = threading.current_thread().name
    assert [(e[1], e[2] == main) for e in compiles(log)][-1] == ("k1", True)  # k1 again, in this thread
    assert ("load", "k0", main) in log
    from triton.runtime import _async_compile

    assert _async_compile.active_mode.get() is None  # no mode left in force


def test_a_failure_shared_by_two_modules_raises_the_compilers_words_from_both(tmp_path, four_cpus, dtypes):
    """Two generated modules can hold kernels of one compile key; Triton's mode compiles it once and
    clears the failure from the first function's cache only. The other's leftover placeholder is
    dropped, so its warm-up compiles again and raises the real error, not an AttributeError."""
    log: list = []
    first, second = (JitLikeKernel(f"k{i}", log, fails="too many registers", compile_key="same") for i in (0, 1))
    modules = [_module(tmp_path, "a", k0=first), _module(tmp_path, "b", k0=second)]
    triton_aot.build_ahead([(None, m, _plan("k0")) for m in modules])
    assert len(compiles(log)) == 1  # one compile for the shared key
    for module in modules:
        with pytest.raises(RuntimeError, match="too many registers"):
            triton_aot.warm_up(program=None, module=module, plan=_plan("k0"))


def _programs():
    from tests.compile.test_launch_tuning import programs

    return programs("rope_swiglu")  # one launch, rows per program and warps free


class CompilingTimer:
    """Fake milliseconds (fewest warps fastest); notes each compile batch and each timing in order. The
    first launch asked about is launch-bound (its candidates are never built), the others are not."""

    def __init__(self) -> None:
        self.events: list = []
        self.asked = 0

    def __call__(self, launch):
        self.events.append(("time", launch))
        return 1.0 + launch.num_warps * 0.1 - launch.block_r * 0.001

    def launch_bound(self, launch, ms):
        self.asked += 1
        return self.asked == 1

    def compile(self, batch):
        self.events.append(("compile", list(batch)))


def test_tuning_builds_every_candidate_it_will_time_at_once_before_timing_any():
    (program, *_) = _programs()
    (launch,) = launches(program)[:1]
    plan = [launch, launch, launch]  # three launches of one kernel: the first launch-bound, two searched
    found = candidates(program, launch)
    assert len(found) > 1
    timer = CompilingTimer()
    tuned = tune(program, timer, plan)
    wanted = found[1:] * 2
    # The defaults timed in order; one batch of every candidate to search; then each searched launch's
    # default again and its candidates, beside each other.
    assert timer.events == ([("time", found[0])] * 3 + [("compile", wanted)] + [("time", c) for c in found * 2])
    assert tuned[0].launch == found[0] and tuned[0].timed == 1
    assert tuned[1].launch == tuned[2].launch == min(found, key=CompilingTimer()) and tuned[1].timed == len(found)
    # Nothing to build ahead when every launch is launch-bound.
    bound = CompilingTimer()
    bound.launch_bound = lambda launch, ms: True
    assert [t.launch for t in tune(program, bound, plan)] == [found[0]] * 3
    assert [e[0] for e in bound.events] == ["time"] * 3


def test_cuda_event_timer_builds_every_candidate_together(tmp_path, four_cpus, dtypes):
    log: list = []
    barrier = threading.Barrier(2)
    module = _module(tmp_path, "abc", k0=JitLikeKernel("k0", log, barrier))
    timer = launch_tuning.CudaEventTimer.__new__(launch_tuning.CudaEventTimer)
    timer.module, timer.program = module, None
    timer.compile(_plan("k0", "k0"))  # two configurations of one kernel (4 and 8 warps)
    assert sorted(e[3]["num_warps"] for e in compiles(log)) == [4, 8]
    assert all(e[2].startswith("accelrun-triton-compile") for e in compiles(log))


def test_build_ahead_compiles_several_regions_kernels_together_and_drops_a_failure(tmp_path, four_cpus, dtypes):
    log: list = []
    barrier = threading.Barrier(2)
    modules = [_module(tmp_path, str(i), k0=JitLikeKernel(f"m{i}", log, barrier)) for i in range(2)]
    modules.append(_module(tmp_path, "2", k0=JitLikeKernel("m2", log, fails="rejected")))
    triton_aot.build_ahead([(None, m, _plan("k0")) for m in modules])  # the failure is left for later
    assert sorted(e[1] for e in compiles(log)) == ["m0", "m1", "m2"]
    assert all(e[2].startswith("accelrun-triton-compile") for e in compiles(log))
    assert not modules[2].k0.device_caches[0][0]  # nothing of the failed one left in its cache
    # The built ones are found built: their warm-ups compile nothing more.
    for module in modules[:2]:
        triton_aot.warm_up(program=None, module=module, plan=_plan("k0"))
    assert len(compiles(log)) == 3


def _lower_two_regions(tmp_path, monkeypatch, events: list):
    """A forward graph of two regions (a matmul between them) lowered by the Triton executor, the GPU
    stood in for; each warm_up's module goes to ``events``."""
    import torch

    from accelrun.compile.executors.aten import AtenExecutor
    from accelrun.compile.executors.triton import TritonExecutor
    from tests.compile.test_codegen_triton import _lowered

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(TritonExecutor, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(TritonExecutor, "runs_anywhere", lambda self: True)
    monkeypatch.setattr(triton_aot, "warm_up", lambda program, module, plan=None: events.append(("warm", module)))

    def fn(x, w):
        return (torch.relu(x * 2) @ w).sin() * 3

    x, w = torch.randn(8, 16), torch.randn(16, 4)
    _, regions, record = _lowered(fn, x, w, executors=[TritonExecutor(), AtenExecutor()], tmp_path=tmp_path)
    return regions, record


def test_the_lowering_gives_the_triton_executor_every_claimed_region_before_compiling_them(tmp_path, monkeypatch):
    def ahead(programs):
        events.append(("ahead", [module for _, module, _ in programs]))

    events: list = []
    monkeypatch.setattr(triton_aot, "build_ahead", ahead)
    regions, record = _lower_two_regions(tmp_path, monkeypatch, events)
    claimed = [r for r in regions if r.lowering.executor == "triton"]
    assert len(claimed) >= 2 and not record.fallbacks
    assert record.cache_misses == len(claimed) and record.cache_hits == 0  # a cold run: nothing was on disk
    (first, *rest) = events
    assert first[0] == "ahead" and [e[0] for e in rest] == ["warm"] * len(claimed)
    assert first[1] == [e[1] for e in rest]  # the same modules, warmed up in turn afterwards


def test_a_failing_head_start_changes_nothing(tmp_path, monkeypatch):
    def ahead(programs):
        raise RuntimeError("no threads left")

    monkeypatch.setattr(triton_aot, "build_ahead", ahead)
    warm: list = []
    regions, record = _lower_two_regions(tmp_path, monkeypatch, warm)
    claimed = [r for r in regions if r.lowering.executor == "triton"]
    assert len(claimed) >= 2 and len(warm) == len(claimed) and not record.fallbacks

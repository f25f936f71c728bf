"""Triton compiles side by side (``triton_aot.parallel_compiles``): a region's launches at warm-up, and a
tuning's candidates before they are timed. On an H200 a cold first step of the 8-layer Llama took 47.5 s
against Inductor's 10.6, most of it tuning's compiles one after another.

No GPU here, so the kernels are fakes that hand their compile to Triton's asynchronous mode exactly as
``triton.jit`` does (``test_torch_private.test_TritonAsyncCompileMode`` holds Triton to that protocol),
and a barrier proves two compiles were in flight at once (a serial run would break it), with no timing."""

from __future__ import annotations

import importlib.util
import threading
from types import SimpleNamespace

import pytest

from accelrun.compile.codegen import launch_tuning, triton_aot
from accelrun.compile.codegen.launch_tuning import candidates, tune
from accelrun.compile.codegen.triton import Launch, launches

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


class JitLikeKernel:
    """``warmup`` as triton.jit's: under an active asynchronous mode the compile goes to its pool and a
    future kernel comes back; otherwise it compiles here. Each compile waits at ``barrier`` (two must
    run at once) and notes its thread; ``_init_handles`` notes its thread too."""

    def __init__(self, name: str, log: list, barrier: threading.Barrier | None = None) -> None:
        self.name, self.log, self.barrier = name, log, barrier

    def warmup(self, *args, grid, **options):
        from triton.runtime import _async_compile

        def build():
            if self.barrier is not None:
                self.barrier.wait(timeout=10)  # BrokenBarrierError if the compiles ran one at a time
            self.log.append(("compile", self.name, threading.current_thread().name, args, grid, options))
            return SimpleNamespace(n_regs=32, n_spills=0, _init_handles=lambda: self.log.append(
                ("load", self.name, threading.current_thread().name)))

        mode = _async_compile.active_mode.get()
        if mode is None:
            return build()
        key = (self.name, tuple(sorted(options.items())))
        return mode.submit(key, build, lambda kernel: None, lambda future: None)


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(triton_aot.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)


def test_compile_threads_one_a_compile_up_to_the_cpus_and_the_cap(monkeypatch):
    monkeypatch.setattr(triton_aot.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert [triton_aot.compile_threads(n) for n in (0, 1, 3, 40)] == [1, 1, 3, triton_aot.MAX_COMPILE_THREADS]
    monkeypatch.setattr(triton_aot.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert triton_aot.compile_threads(8) == 1


def test_warm_up_builds_a_regions_launches_together_then_loads_them_here(tmp_path, monkeypatch, four_cpus):
    log: list = []
    barrier = threading.Barrier(2)
    module = SimpleNamespace(__file__=str(tmp_path / "accelrun_abc.py"),
                             k0=JitLikeKernel("k0", log, barrier), k1=JitLikeKernel("k1", log, barrier))  # fmt: skip
    plan = [Launch("k0", (4,), ("x",), block_r=1, block_n=16, num_warps=4),
            Launch("k1", (2,), ("x",), block_r=2, block_n=16, num_warps=8)]  # fmt: skip
    monkeypatch.setattr(triton_aot, "launches", lambda program: plan)
    monkeypatch.setattr(triton_aot, "buffer_dtypes", lambda program: {"x": "fp32"})
    lines = triton_aot.warm_up(program=None, module=module)
    assert lines == ["k0: 32 registers, 0 spills, 4 warps", "k1: 32 registers, 0 spills, 8 warps"]
    compiles = [e for e in log if e[0] == "compile"]
    assert {e[1] for e in compiles} == {"k0", "k1"}
    assert all(e[2].startswith("accelrun-triton-compile") for e in compiles)  # on the pool
    # Every binary is loaded after every compile finished, in this thread (the CUDA context's), in order.
    main = threading.current_thread().name
    assert log[2:] == [("load", "k0", main), ("load", "k1", main)]


def test_warm_up_compiles_in_this_thread_with_one_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_aot.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    log: list = []
    module = SimpleNamespace(__file__=str(tmp_path / "accelrun_abc.py"), k0=JitLikeKernel("k0", log),
                             k1=JitLikeKernel("k1", log))  # fmt: skip
    plan = [Launch("k0", (4,), (), block_r=1, block_n=16, num_warps=4), Launch("k1", (4,), (), 1, 16, 4)]
    monkeypatch.setattr(triton_aot, "launches", lambda program: plan)
    monkeypatch.setattr(triton_aot, "buffer_dtypes", lambda program: {})
    triton_aot.warm_up(program=None, module=module)
    assert {e[2] for e in log} == {threading.current_thread().name}


def test_a_failed_compile_raises_from_the_warm_up(tmp_path, monkeypatch, four_cpus):
    class Rejected(JitLikeKernel):
        def warmup(self, *args, grid, **options):
            from triton.runtime import _async_compile

            def build():
                raise RuntimeError("out of resources: shared memory")

            return _async_compile.active_mode.get().submit("bad", build, lambda k: None, lambda f: None)

    log: list = []
    module = SimpleNamespace(__file__=str(tmp_path / "accelrun_abc.py"), k0=JitLikeKernel("k0", log),
                             k1=Rejected("k1", log))  # fmt: skip
    plan = [Launch("k0", (4,), (), block_r=1, block_n=16, num_warps=4), Launch("k1", (4,), (), 1, 16, 4)]
    monkeypatch.setattr(triton_aot, "launches", lambda program: plan)
    monkeypatch.setattr(triton_aot, "buffer_dtypes", lambda program: {})
    with pytest.raises(RuntimeError, match="out of resources"):
        triton_aot.warm_up(program=None, module=module)
    assert not [e for e in log if e[0] == "load"]  # nothing loaded from a failed warm-up


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


class BuildsAtFirstCall(CompilingTimer):
    compile = None  # type: ignore[assignment]  (tune then builds nothing ahead)


def test_tuning_builds_every_candidate_it_will_time_at_once_before_timing_any():
    (program, *_) = _programs()
    (launch,) = launches(program)[:1]
    plan = [launch, launch, launch]  # three launches of one kernel: the first launch-bound, two searched
    found = candidates(program, launch)
    assert len(found) > 1
    timer = CompilingTimer()
    tuned = tune(program, timer, plan)
    wanted = found[1:] * 2
    # The defaults timed in order, then one batch of every candidate to search, then those timed.
    assert timer.events == ([("time", found[0])] * 3 + [("compile", wanted)] + [("time", c) for c in wanted])
    assert tuned[0].launch == found[0] and tuned[0].timed == 1
    assert tuned[1].launch == tuned[2].launch == min(found, key=CompilingTimer()) and tuned[1].timed == len(found)
    # The same choices as a timer that builds each candidate at its first timing.
    plain = BuildsAtFirstCall()
    assert tune(program, plain, plan) == tuned
    assert plain.events == [("time", found[0])] * 3 + [("time", c) for c in wanted]


def test_cuda_event_timer_builds_candidates_for_the_calls_buffers(tmp_path, four_cpus):
    log: list = []
    barrier = threading.Barrier(2)
    module = SimpleNamespace(k0=JitLikeKernel("k0", log, barrier))
    timer = launch_tuning.CudaEventTimer.__new__(launch_tuning.CudaEventTimer)
    timer.module, timer.buffers, timer.by_kernel = module, ["x0", "y0", "scratch"], {"k0": (0, 2)}
    a = Launch("k0", (4,), ("x", "s"), block_r=1, block_n=16, num_warps=2)
    b = Launch("k0", (2,), ("x", "s"), block_r=2, block_n=16, num_warps=8)
    timer.compile([a, b])
    assert sorted((e[3], e[4], e[5]["num_warps"]) for e in log) == [(("x0", "scratch"), (2,), 8),
                                                                    (("x0", "scratch"), (4,), 2)]  # fmt: skip
    assert all(e[2].startswith("accelrun-triton-compile") for e in log)


def test_build_ahead_compiles_several_regions_kernels_together_and_drops_a_failure(tmp_path, monkeypatch,
                                                                                   four_cpus):  # fmt: skip
    class Rejected(JitLikeKernel):
        def warmup(self, *args, grid, **options):
            from triton.runtime import _async_compile

            def build():
                raise RuntimeError("out of resources: shared memory")

            return _async_compile.active_mode.get().submit("bad", build, lambda k: None, lambda f: None)

    log: list = []
    barrier = threading.Barrier(2)
    modules = [SimpleNamespace(__file__=str(tmp_path / f"accelrun_{i}.py"), k0=JitLikeKernel(f"m{i}", log, barrier))
               for i in range(2)]  # fmt: skip
    modules.append(SimpleNamespace(__file__=str(tmp_path / "accelrun_2.py"), k0=Rejected("m2", log)))
    plan = [Launch("k0", (4,), ("x",), block_r=1, block_n=16, num_warps=4)]
    monkeypatch.setattr(triton_aot, "buffer_dtypes", lambda program: {"x": "fp32"})
    triton_aot.build_ahead([(None, m, plan) for m in modules])  # the failure is left for its warm-up
    assert sorted(e[1] for e in log) == ["m0", "m1"]
    assert all(e[2].startswith("accelrun-triton-compile") for e in log)


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

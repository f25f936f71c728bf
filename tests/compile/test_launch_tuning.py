"""compile.tune_launches on the CPU: every candidate configuration computes what the default does
(Triton's interpreter runs them), the search keeps the fastest by a fake timer, the choice is written
beside the kernel and read back by a second "process" without timing, and a new source or device
misses. Cross-compiling every candidate for sm_90 with no spills is in test_triton_real_compile.py."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace

import pytest
import torch

from accelrun.compile.codegen import launch_tuning
from accelrun.compile.codegen import triton as triton_codegen
from accelrun.compile.codegen.launch_tuning import (
    DeviceKey,
    KernelKind,
    TuningCache,
    candidates,
    kernel_of,
    tune,
    tuned_launches,
)
from accelrun.compile.codegen.loop_ir import cached_program
from accelrun.compile.codegen.triton import launches, scratch_buffers
from tests.compile.test_codegen_triton import CASES, regions_of

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

H100 = DeviceKey("NVIDIA H100 80GB HBM3", (9, 0), "3.6.0")
H200 = DeviceKey("NVIDIA H200", (9, 0), "3.6.0")


SMALL_CASES = {
    # a column reduction cut into 4 chunks of rows (tiles of 64 elements: 8 rows of 8 columns)
    "cols_split_small": lambda: (lambda x: x.amax(0) * 2, torch.randn(64, 8, requires_grad=True)),
    # one long row of 3 column blocks: columns per program free
    "pointwise_1d": lambda: (lambda x: x.sin() * 2, torch.randn(3000, requires_grad=True)),
}


def programs(name: str):
    fn, *args = (SMALL_CASES | CASES)[name]()
    return [cached_program(r) for r in regions_of(fn, *args, device="cpu")]


def run_plan(module, program, plan, inputs):
    """The program's kernels launched as ``plan`` says, on fresh outputs and scratch; its outputs."""
    bufs = dict(inputs)
    for b in program.buffers:
        if b.name not in bufs:
            bufs[b.name] = torch.full(b.shape, float("nan") if b.dtype.is_floating_point else -7, dtype=b.dtype)
    for s in scratch_buffers(program):
        bufs[s.name] = torch.full(s.shape, float("nan") if s.dtype.is_floating_point else -7, dtype=s.dtype)
    for ln in plan:
        getattr(module, ln.kernel)[ln.grid](*[bufs[a] for a in ln.args], **ln.options())
    return [bufs[b.name] for b in program.of_role("output")]


# Small shapes that reach every kind of kernel (the tile, the loop length and the column split made
# small, so that the interpreter runs them in seconds).
@pytest.mark.parametrize("case, patch", [
    ("rope_swiglu", {"TILE_ELEMENTS": 16}),  # pointwise, several row blocks: rows per program free
    ("pointwise_1d", {}),
    ("softmax_log_softmax", {"TILE_ELEMENTS": 64}),  # rows reduced whole, 2 a program: rows per program free
    ("exp_normalised", {"MAX_ROW": 16, "LOOP_BLOCK_N": 16}),  # rows walked in steps
    ("cols_split_small", {"TILE_ELEMENTS": 64}),  # a column reduction in two stages
])  # fmt: skip
def test_every_candidate_computes_what_the_default_computes(monkeypatch, tmp_path, case, patch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for key, value in patch.items():
        monkeypatch.setattr(triton_codegen, key, value)
    kinds, tried, blocks = set(), 0, set()
    for program in programs(case):
        source = triton_codegen.triton_source(program)
        module = triton_codegen.load_module(source, tmp_path)
        gen = torch.Generator().manual_seed(0)
        inputs = {b.name: (torch.randn(b.shape, generator=gen).to(b.dtype) if b.dtype.is_floating_point
                           else torch.randint(0, 3, b.shape, generator=gen).to(b.dtype))
                  for b in program.of_role("input")}  # fmt: skip
        default = launches(program)
        want = run_plan(module, program, default, inputs)
        for i, launch in enumerate(default):
            kinds.add(kernel_of(program, launch)[1])
            found = candidates(program, launch)
            blocks |= {(c.block_r, c.block_n) for c in found} - {(launch.block_r, launch.block_n)}
            assert found[0].block_r == launch.block_r and found[0].block_n == launch.block_n
            for c in found[1:]:
                got = run_plan(module, program, [*default[:i], c, *default[i + 1 :]], inputs)
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m, c=c: f"{c}: {m}")
                tried += 1
    assert tried > 0 and blocks, "some candidate has other block sizes than the default"
    expected = {"rope_swiglu": KernelKind.POINTWISE, "pointwise_1d": KernelKind.POINTWISE, "softmax_log_softmax": KernelKind.ROWS,
                "exp_normalised": KernelKind.LOOPED_ROWS, "cols_split_small": KernelKind.COLS_FINAL}[case]
    assert expected in kinds, kinds
    if case == "cols_split_small":
        assert KernelKind.COLS in kinds


def test_candidates_vary_only_what_the_source_leaves_free():
    (program, *_) = programs("softmax_log_softmax")  # 5 rows of 24: one row block, held whole
    (launch,) = [ln for ln in launches(program) if kernel_of(program, ln)[1] is KernelKind.ROWS][:1]
    found = candidates(program, launch)
    assert {(c.block_r, c.block_n) for c in found} == {(launch.block_r, launch.block_n)}  # no row offset written
    assert len({c.num_warps for c in found}) == len(found) and len(found) <= launch_tuning.MAX_CANDIDATES


class FakeTimer:
    """Milliseconds by configuration: the fewest warps and the largest BLOCK_R are fastest."""

    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, launch):
        self.calls.append(launch)
        return 1.0 + launch.num_warps * 0.1 - launch.block_r * 0.001


def test_the_search_keeps_the_fastest_and_the_default_within_the_margin():
    (program, *_) = programs("rope_swiglu")
    timer = FakeTimer()
    tuned = tune(program, timer)
    # A searched launch's default is timed twice: in order with the other defaults, then beside its rivals.
    assert len(tuned) == len(launches(program))
    assert len(timer.calls) == sum(t.timed for t in tuned) + sum(t.timed > 1 for t in tuned)
    for t, launch in zip(tuned, launches(program), strict=True):
        best = min(candidates(program, launch), key=timer)
        assert t.launch == best and t.ms == timer(best) and t.default_ms == timer(candidates(program, launch)[0])
    defaults = [candidates(program, ln)[0] for ln in launches(program)]
    flat = tune(program, lambda launch: 1.0)  # nothing faster than the default: the default
    assert [t.launch for t in flat] == defaults
    # Faster by less than the margin (timing noise): the default stays.
    close = tune(program, lambda launch: 1.0 if launch in defaults else 1.0 - launch_tuning.MARGIN / 2)
    assert [t.launch for t in close] == defaults


def test_a_candidate_the_device_refuses_is_passed_over():
    """Shared memory is checked only when a binary loads on the device: one refused candidate must not
    take the region off Triton."""
    (program, *_) = programs("rope_swiglu")
    timer = FakeTimer()
    fastest = {min(candidates(program, ln), key=timer) for ln in launches(program)}
    defaults = [candidates(program, ln)[0] for ln in launches(program)]
    refused = fastest - set(defaults)
    assert refused  # some fastest candidate is not a default

    def refusing(launch):
        if launch in refused:
            raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")
        return timer(launch)

    tuned = tune(program, refusing)
    assert not {t.launch for t in tuned} & refused and len(tuned) == len(defaults)

    def refusing_defaults(launch):
        if launch in defaults:
            raise RuntimeError("out of resource: shared memory")
        return timer(launch)

    with pytest.raises(RuntimeError, match="out of resource"):  # a default that fails is the region's failure
        tune(program, refusing_defaults)


def test_a_launch_bound_kernel_keeps_its_default_without_compiling_candidates():
    (program, *_) = programs("rope_swiglu")
    timer = FakeTimer()
    small = tune(program, lambda launch: timer(launch) * launch_tuning.SMALL_KERNEL_MS / 2)
    defaults = [candidates(program, ln)[0] for ln in launches(program)]
    assert [t.launch for t in small] == defaults and [t.timed for t in small] == [1] * len(defaults)
    assert timer.calls == defaults  # only the defaults were launched (each candidate is a compile)


def test_a_timer_that_tells_launch_bound_kernels_decides_instead_of_the_threshold():
    """The CUDA timer knows the host's time to issue each launch: a kernel the device runs no slower than
    the host issues it is launch-bound, however many microseconds that is on this host."""
    (program, *_) = programs("rope_swiglu")
    defaults = [candidates(program, ln)[0] for ln in launches(program)]

    class HostPaced(FakeTimer):  # 1 ms a launch (far above SMALL_KERNEL_MS), all of it the host's
        def launch_bound(self, launch, ms):
            return True

    paced = HostPaced()
    assert [t.launch for t in tune(program, paced)] == defaults and paced.calls == defaults
    timer = launch_tuning.CudaEventTimer.__new__(launch_tuning.CudaEventTimer)
    timer.host_ms = {defaults[0]: 0.020}  # 20 us to issue a launch
    assert timer.launch_bound(defaults[0], 0.022) and not timer.launch_bound(defaults[0], 0.060)


def test_tuned_once_then_read_back_by_another_process_without_timing(tmp_path):
    (program, *_) = programs("rope_swiglu")
    module_file = triton_codegen.module_path(triton_codegen.triton_source(program), tmp_path)
    module_file.parent.mkdir(parents=True, exist_ok=True)
    module_file.write_text(triton_codegen.triton_source(program))
    made = []

    def make_timer():
        made.append(FakeTimer())
        return made[-1]

    first = tuned_launches(program, module_file, H100, make_timer)
    assert first.source == "tuned" and len(made) == 1 and made[0].calls
    written = TuningCache(module_file).path(H100)
    assert written.parent == tmp_path / "bin" / "launches"  # beside the kernels' binaries
    data = json.loads(written.read_text())
    assert data["device"]["name"] == H100.name and len(data["launches"]) == len(first.launches)
    # A second process: a new cache object over the same files; nothing is timed.
    second = tuned_launches(program, module_file, H100, lambda: pytest.fail("timed again"))
    assert second.source == "cache" and second.launches == first.launches
    assert first.launches != launches(program)  # the fake timer's choice, not the defaults, came back
    # Another device misses (and is tuned and kept apart); the H100's file stays.
    other = tuned_launches(program, module_file, H200, make_timer)
    assert other.source == "tuned" and len(made) == 2 and written.exists()
    # The source changed under the same name: its hash no longer matches, the file is a miss.
    module_file.write_text(module_file.read_text() + "\n# edited\n")
    assert TuningCache(module_file).read(H100) is None
    assert tuned_launches(program, module_file, H100, make_timer).source == "tuned" and len(made) == 3


def test_a_damaged_file_is_a_miss(tmp_path):
    module_file = tmp_path / "accelrun_x.py"
    module_file.write_text("pass\n")
    cache = TuningCache(module_file)
    cache.path(H100).parent.mkdir(parents=True)
    cache.path(H100).write_text("{not json")
    assert cache.read(H100) is None
    assert cache.path(H100) != cache.path(replace(H100, triton="3.7.0"))


def _ptxas_present() -> bool:
    from tests.compile.test_triton_real_compile import _ptxas_present as present

    return present()


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None and not _ptxas_present(),
                    reason="this triton has no NVIDIA backend with its ptxas")  # fmt: skip
def test_every_candidate_cross_compiles_for_sm90_without_spills():
    """Each kind of kernel at real widths (RMSNorm's rows and its weight gradient's columns at 4096, the
    loss's rows looped at Llama 3's vocabulary, SwiGLU pointwise over 2 x 256 x 1024), every candidate
    through Triton's real compiler for sm_90 and ptxas: all compile, none spills."""
    import torch.nn.functional as F

    from accelrun.compile.codegen.triton_aot import cross_compile
    from tests.compile.test_triton_real_compile import regions_of, rmsnorm

    regions = (regions_of(rmsnorm, torch.randn(2, 4, 4096, requires_grad=True), torch.randn(4096, requires_grad=True))
               + regions_of(lambda lg, t: F.cross_entropy(lg.float(), t), torch.randn(4, 128256, requires_grad=True),
                            torch.randint(0, 128256, (4,)))
               + regions_of(lambda a, b: F.silu(a) * b, torch.randn(2, 256, 1024, requires_grad=True),
                            torch.randn(2, 256, 1024, requires_grad=True)))  # fmt: skip
    kinds, compiled, failed, spilled = set(), 0, [], []
    for region in regions:
        program = cached_program(region)
        source = triton_codegen.triton_source(program)
        plan = [c for ln in launches(program) for c in candidates(program, ln)]
        kinds |= {kernel_of(program, c)[1] for c in plan}
        try:
            done = cross_compile(program, source, 90, plan=plan)
        except Exception as e:  # noqa: BLE001  (reported below)
            failed.append(f"region {region.id}: {type(e).__name__}: {str(e).splitlines()[:2]}")
            continue
        compiled += len(done)
        spilled += [f"{k.launch}: {k.spill_bytes} bytes" for k in done if k.spill_bytes]
        assert all(k.registers is not None and 0 < k.registers <= 255 for k in done)
    print(f"launch candidates cross-compiled for sm_90: {compiled}, failed {len(failed)}, spilled {len(spilled)}")
    assert not failed, "\n".join(failed)
    assert not spilled, "\n".join(spilled)
    assert kinds >= {KernelKind.POINTWISE, KernelKind.ROWS, KernelKind.LOOPED_ROWS, KernelKind.COLS}, kinds

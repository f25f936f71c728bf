"""Triton kernels whose row count is read at each call (codegen/runtime_rows.py, triton_rows_region.py):
the regions of tests/compile/test_runtime_rows.py through the Triton generator, run by Triton's
interpreter on the CPU for counts they were not lowered for, against eager in float64; compiled for
sm_90 by Triton's real compiler (no GPU needed); through a pickle (the graph cache); an expert whose
token count changes at every call, compiled once for any count; and what the generator declines.
With ACCELRUN_TRITON_TEST_DEVICE=cuda (bench/gpu_smoke.sh) the regions run on the GPU, compiled."""

from __future__ import annotations

import importlib.util
import os
import pickle

import pytest
import torch

from accelrun.compile.codegen import triton as triton_codegen
from accelrun.compile.codegen.loop_ir import Unsupported
from accelrun.compile.codegen.runtime_rows import lower_with_runtime_rows
from accelrun.compile.codegen.triton_rows_region import TritonRowsRegion
from accelrun.compile.executors.triton import TritonExecutor
from tests.compile.test_runtime_rows import _region, residual_norm_backward, silu_backward

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

DEVICE = os.environ.get("ACCELRUN_TRITON_TEST_DEVICE", "cpu")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytestmark = [pytestmark, pytest.mark.skip(reason=f"ACCELRUN_TRITON_TEST_DEVICE={DEVICE} but no CUDA device")]


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels run by the interpreter on the CPU; compiled on the GPU when DEVICE is cuda."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE)


def _compiled(region, tmp_path) -> TritonRowsRegion:
    ex = TritonExecutor()
    region.program = lower_with_runtime_rows(region)  # as executors.generated.with_runtime_rows sets it
    assert ex.decline_reason(region) is None, ex.decline_reason(region)
    fn = ex.compile(region, str(tmp_path))
    assert isinstance(fn, TritonRowsRegion)
    return fn


def test_silu_backward_and_the_bias_gradient_for_any_number_of_rows(tmp_path):
    """A rows kernel and a column reduction over the rows (two stages: chunks of whole tiles, their
    rows worked out at each call), for counts of 1, a few, more than a tile and not a multiple of one."""
    region = _region(silu_backward, randn(40, 48), randn(40, 48))
    fn = _compiled(region, tmp_path)
    source = region.lowering.sources["triton"].text
    assert "n_rows" in source and "_nx48(" in source and "rows_per_chunk" in source, source
    assert "8191" not in source  # the made-up count lowered for appears nowhere in the kernels
    assert ".to(tl.int64)" in source  # rows past 2**31 elements: the build checked the made-up count only
    # 0 rows; and past the count lowered for, where the chunks are capped and each takes more rows
    for n in (0, 1, 7, 40, 333, 9000):
        x, g = randn(n, 48), randn(n, 48)
        got, want = fn(x, g), silu_backward(x.double(), g.double())
        assert got[0].shape == (n, 48) and got[1].shape == (1, 48)
        torch.testing.assert_close(got[0], want[0].float(), rtol=1e-5, atol=1e-5)
        scale = want[0].abs().sum(0, keepdim=True)
        assert ((got[1].double() - want[1]).abs() <= 1e-5 * scale + 1e-6).all(), n


def test_sequences_of_changing_length_run_as_their_rows(tmp_path):
    """[4, s, 48] tensors whose length changes: read as 4·s rows, the output viewed back."""
    region = _region(residual_norm_backward, randn(4, 40, 48), randn(4, 40, 48), dynamic=(1,))
    fn = _compiled(region, tmp_path)
    for s in (1, 3, 17):
        x, g = randn(4, s, 48), randn(4, s, 48)
        got, want = fn(x, g), residual_norm_backward(x.double(), g.double())
        assert got[0].shape == (4, s, 48) and got[1].shape == (48,)
        torch.testing.assert_close(got[0], want[0].float(), rtol=1e-5, atol=1e-5)
        scale = (g.double().view(-1, 48) * x.double().view(-1, 48)).abs().sum(0) + 1
        assert ((got[1].double() - want[1]).abs() <= 1e-5 * scale).all(), s
    with pytest.raises(ValueError, match=r"where \[4, -1, 48\]"):
        fn(randn(8, 5, 48), randn(8, 5, 48))


def test_short_rows_run_as_one_flat_loop_over_n_times_their_length(tmp_path):
    def fn(x):
        return torch.tanh(x) * 2 + 1

    region = _region(fn, randn(32, 8))
    compiled = _compiled(region, tmp_path)
    assert "n_rows * 8" in region.lowering.sources["triton"].text
    for n in (0, 1, 5, 300):
        x = randn(n, 8)
        torch.testing.assert_close(compiled(x)[0], fn(x), rtol=1e-5, atol=1e-6)


def test_an_input_laid_out_otherwise_is_copied_to_the_kernels_layout(tmp_path):
    fn = _compiled(_region(silu_backward, randn(40, 48), randn(40, 48)), tmp_path)
    x, g = randn(48, 9).t(), randn(9, 48)
    for a, b in zip(fn(x, g), silu_backward(x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_compiled_form_pickles_with_its_runtime_rows(tmp_path):
    """As the graph cache saves it: the module found again by its file, the program's runtime rows kept."""
    fn = _compiled(_region(silu_backward, randn(40, 48), randn(40, 48)), tmp_path)
    again = pickle.loads(pickle.dumps(fn))
    assert isinstance(again, TritonRowsRegion) and again.program.runtime_rows == fn.program.runtime_rows
    x, g = randn(21, 48), randn(21, 48)
    for a, b in zip(again(x, g), fn(x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_sum_over_a_changing_number_of_elements_is_declined_with_its_reason(tmp_path):
    """A flat kernel that reduces all n·k elements would need a reduction of changing length: the
    Triton generator declines it (the region stays in another executor, with the reason)."""
    region = _region(lambda x: (torch.tanh(x) * 2).sum(), randn(32, 8))
    region.program = lower_with_runtime_rows(region)
    assert region.program.runtime_rows.flat_kernels
    assert "a reduction over all n·k elements" in TritonExecutor().decline_reason(region)


def test_runtime_rows_kernels_compile_for_sm90_without_spills():
    """Triton's real compiler (cross-compiling, no GPU) takes the kernels with their integer arguments."""
    from accelrun.compile.codegen.triton_aot import cross_compile

    for fn, shapes, dynamic in ((silu_backward, [(40, 48)] * 2, (0,)),
                                (residual_norm_backward, [(4, 40, 48)] * 2, (1,)),
                                (lambda x: torch.tanh(x) * 2 + 1, [(32, 8)], (0,))):  # fmt: skip
        program = lower_with_runtime_rows(_region(fn, *[randn(s) for s in shapes], dynamic=dynamic))
        done = cross_compile(program, triton_codegen.triton_source(program), 90)
        assert done and all(k.spill_bytes == 0 for k in done), [(k.launch.kernel, k.spill_bytes) for k in done]
        assert all(k.launch.scalars for k in done if not k.launch.kernel.endswith("_final"))


def test_an_expert_whose_token_count_changes_compiles_once_for_any_count(tmp_path):
    """A mixture's expert through the backend with the Triton executor: the first size, then one graph
    for any size whose SiLU regions (forward and backward) are Triton's, reading the count at each call."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.compile.passes.base import resolve_passes

    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("default"), executors=["triton", "aten"],
                                             cache_dir=tmp_path / "cache"))  # fmt: skip
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16)).to(DEVICE)
    compiled = torch.compile(expert, backend=backend)
    for rows in (40, 52, 61, 3):
        x = randn(rows, 16).requires_grad_()
        out, ref = compiled(x), expert(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        (got,) = torch.autograd.grad(out.square().sum(), x)
        (want,) = torch.autograd.grad(ref.square().sum(), x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    record = backend.record
    assert record.dynamo_graphs == 2, record.compiled_line()
    rows = [r for r in record.regions if r.runtime_rows]
    assert rows and all(r.executor == "triton" for r in rows), record.regions
    assert {r.graph for r in rows} == {"g1.forward", "g1.backward"}, record.regions
    torch._dynamo.reset()


def test_rows_a_mask_picked_run_in_triton_kernels_that_read_their_count(tmp_path):
    """A size read from the data (an unbacked symbol: the rows a boolean mask picks): every row, some,
    one, none; one graph, its region Triton's with runtime rows."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.compile.passes.base import resolve_passes

    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("default"), executors=["triton", "aten"],
                                             cache_dir=tmp_path / "cache"))  # fmt: skip

    from tests.compile.user_models import mask_choices, rows_picked_by_a_mask

    torch.manual_seed(0)
    w, x = randn(8, 8), randn(32, 8)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(rows_picked_by_a_mask, backend=backend, fullgraph=True)
        for chosen in mask_choices(x):
            torch.testing.assert_close(compiled(chosen, w), rows_picked_by_a_mask(chosen, w), rtol=1e-5, atol=1e-6)
    record = backend.record
    assert not record.fallbacks and record.dynamo_graphs == 1, record.compiled_line()
    assert [r.executor for r in record.regions if r.runtime_rows] == ["triton"], record.regions
    torch._dynamo.reset()


def test_a_length_read_at_each_call_is_declined_by_triton(tmp_path):
    """Sizes that follow a length (a·s + b, codegen.linear_sizes) are the C++ generator's alone."""
    from accelrun.compile.codegen.loop_ir import LoopProgram

    program = LoopProgram([], [], linear_sizes=object())
    with pytest.raises(Unsupported, match="a length read at each call"):
        triton_codegen.triton_source(program)

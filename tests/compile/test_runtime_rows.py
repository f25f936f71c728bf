"""C++ kernels whose number of rows is read at each call (codegen/runtime_rows.py): a region traced
with a symbolic leading size, lowered once, run for many sizes against eager's results; the cases it
must refuse, each with its reason; the compiled form through a pickle (the graph cache)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from accelrun.compile.codegen.cpp import CppRowsRegion, cpp_region, cpp_source
from accelrun.compile.codegen.cpp_build import build_library, load_library
from accelrun.compile.codegen.loop_ir import Unsupported
from accelrun.compile.codegen.runtime_rows import lower_with_runtime_rows
from accelrun.compile.regions import Region


def _region(fn, *tensors: torch.Tensor, dynamic=(0,)) -> Region:
    """``fn`` traced on fake tensors whose axes in ``dynamic`` are symbols, as Dynamo leaves a size it
    saw change between calls; equal sizes share a symbol."""
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t: torch.Tensor) -> torch.Tensor:
        sizes = [DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    fakes = [fake(t) for t in tensors]
    with mode:
        gm = make_fx(fn)(*fakes)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    outputs = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return Region(0, gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"],
                  [n.meta["val"] for n in outputs])  # fmt: skip


def _compiled(region: Region, tmp_path) -> CppRowsRegion:
    program = lower_with_runtime_rows(region)
    fn = cpp_region(program, load_library(build_library(cpp_source(program), str(tmp_path))))
    assert isinstance(fn, CppRowsRegion)
    return fn


def silu_backward(x, g):
    s = torch.sigmoid(x)
    y = g * s * (1 + x * (1 - s))
    return y, y.sum(0, keepdim=True)


def test_silu_backward_and_the_bias_gradient_for_any_number_of_rows(tmp_path):
    """An expert's SiLU backward and its bias's gradient (a sum over the rows): one kernel pair, run
    for row counts it was not lowered for, 1 and a count with no thread's share even among them."""
    region = _region(silu_backward, torch.randn(40, 48), torch.randn(40, 48))
    program = lower_with_runtime_rows(region)
    rows = program.runtime_rows
    assert rows.input == "in0" and rows.buffers == {"in0", "in1", "out0"}, rows
    assert {k.kind for k in program.kernels if k.name in rows.kernels} == {"rows", "cols"}
    assert "n = in0.size(0) at each call" in program.describe() and "[n, 48]" in program.describe()
    assert "const int64_t R = n * 1" in cpp_source(program)
    fn = _compiled(region, tmp_path)
    for n in (1, 2, 7, 40, 333, 4099):
        x, g = torch.randn(n, 48), torch.randn(n, 48)
        got, want = fn(x, g), silu_backward(x.double(), g.double())
        assert got[0].shape == (n, 48) and got[1].shape == (1, 48)
        torch.testing.assert_close(got[0], want[0].float(), rtol=1e-5, atol=1e-5)
        # a sum of n rows, against float64's: within 1e-5 of the size of what was summed
        scale = want[0].abs().sum(0, keepdim=True)
        assert ((got[1].double() - want[1]).abs() <= 1e-5 * scale + 1e-6).all(), n


def residual_norm_backward(x, g):
    """A residual stream's [batch, length, dim] tensors seen as rows, as a transformer block's
    backward sees them: a norm-like row reduction, and a weight gradient summed over every row."""
    x2, g2 = x.view(-1, 48), g.view(-1, 48)
    centred = x2 - x2.mean(-1, keepdim=True)
    y = g2 * centred + x2
    return y.view(x.shape[0], -1, 48), (g2 * centred).sum(0)


def test_sequences_of_changing_length_run_as_their_rows(tmp_path):
    """[4, s, 48] tensors whose length ``s`` changes: the kernels loop over 4·s rows read at each call
    (the inputs viewed as rows, the output viewed back), for lengths they were not lowered for."""
    region = _region(residual_norm_backward, torch.randn(4, 40, 48), torch.randn(4, 40, 48), dynamic=(1,))
    program = lower_with_runtime_rows(region)
    rows = program.runtime_rows
    assert dict(rows.leading_axes) == {"in0": (4, -1), "in1": (4, -1), "out0": (4, -1)}, rows
    assert "n = in0.size(0) * in0.size(1) at each call" in program.describe(), program.describe()
    fn = _compiled(region, tmp_path)
    for s in (1, 3, 40, 257):
        x, g = torch.randn(4, s, 48), torch.randn(4, s, 48)
        got, want = fn(x, g), residual_norm_backward(x.double(), g.double())
        assert got[0].shape == (4, s, 48) and got[1].shape == (48,)
        torch.testing.assert_close(got[0], want[0].float(), rtol=1e-5, atol=1e-5)
        scale = (g.double().view(-1, 48) * x.double().view(-1, 48)).abs().sum(0) + 1
        assert ((got[1].double() - want[1]).abs() <= 1e-5 * scale).all(), s
    # Read as rows, an input must still have the sizes it was compiled for, but for the length.
    for wrong in [(4, 10, 6, 8), (8, 5, 48)]:
        with pytest.raises(ValueError, match=r"where \[4, -1, 48\]"):
            fn(torch.randn(wrong), torch.randn(4, 10, 48))


def test_short_rows_run_as_one_flat_loop_over_n_times_their_length(tmp_path):
    """Rows of 8 are too short an inner loop: the kernel loops over all n·8 elements, in chunks whose
    number it works out at each call (no rows, a few, more than one thread's chunk)."""

    def fn(x):
        return torch.tanh(x) * 2 + 1

    region = _region(fn, torch.randn(32, 8))
    program = lower_with_runtime_rows(region)
    assert program.runtime_rows.flat_kernels == {program.kernels[0].name}
    assert "rows [] x cols [n, 8]" in program.describe(), program.describe()
    fn_c = _compiled(region, tmp_path)
    for n in (0, 1, 5, 32, 4096):
        x = torch.randn(n, 8)
        torch.testing.assert_close(fn_c(x)[0], fn(x), rtol=1e-5, atol=1e-6)


def test_an_input_laid_out_otherwise_is_copied_to_the_kernels_layout(tmp_path):
    region = _region(silu_backward, torch.randn(40, 48), torch.randn(40, 48))
    fn = _compiled(region, tmp_path)
    x, g = torch.randn(48, 9).t(), torch.randn(9, 48)
    for a, b in zip(fn(x, g), silu_backward(x, g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_compiled_form_pickles_with_its_runtime_rows(tmp_path):
    """The graph cache saves a compiled region by its library and buffers: loaded again, it still
    reads the row count at each call."""
    region = _region(silu_backward, torch.randn(40, 48), torch.randn(40, 48))
    loaded = pickle.loads(pickle.dumps(_compiled(region, tmp_path)))
    assert isinstance(loaded, CppRowsRegion)
    x, g = torch.randn(77, 48), torch.randn(77, 48)
    torch.testing.assert_close(loaded(x, g)[0], silu_backward(x, g)[0], rtol=1e-5, atol=1e-5)


def swiglu_gate(h):
    return torch.sigmoid(h) * h * 2


def test_a_fresh_batch_whose_size_was_read_from_a_tensor_runs_as_its_rows(tmp_path):
    """A mixture of experts pads each expert's tokens to the widest expert's count, read from a tensor:
    torch makes that [8, s, 32] batch's strides ``32*Max(1, s)``, not knowing s >= 1. Its rows are
    laid out as rows all the same (left to ATen before: its SiLU forward and backward)."""
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    s = env.create_unspecified_symint_and_symbol(40, ConstantSource("widest"), DimDynamic.DYNAMIC)
    with mode:
        batch = torch.zeros(8, s, 32)
        assert "Max(1" in str(batch.stride()[0])  # what torch writes, the case under test
        gm = make_fx(lambda h: (swiglu_gate(h),))(batch)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    region = Region(0, gm, [batch], [out.args[0][0].meta["val"]])
    program = lower_with_runtime_rows(region)
    assert dict(program.runtime_rows.leading_axes) == {"in0": (8, -1), "out0": (8, -1)}, program.runtime_rows
    fn = _compiled(region, tmp_path)
    for n in (0, 1, 5, 40, 333):
        h = torch.randn(8, n, 32)
        torch.testing.assert_close(fn(h)[0], swiglu_gate(h), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("fn", "shapes", "dynamic", "reason"), [
    (lambda x: (x.t() * 2).sin(), [(40, 8)], (0,), "past a tensor's leading axis"),
    (lambda x, y: (x * 2, y * 3), [(40, 8), (52, 8)], (0,), "2 changing sizes"),
    (lambda x: x.amax(0, keepdim=True) + 1, [(40, 8)], (0,), "a max or min over"),
    (lambda x: x - x.mean(0, keepdim=True), [(40, 64)], (0,), "used past the rows a kernel loops over"),
    (lambda x: x.transpose(0, 1) * 2, [(4, 40, 8)], (1,), "a changing stride"),
    (lambda x: x.transpose(0, 1) * 2, [(40, 4, 8)], (0,), "not laid out as rows"),
    (lambda x: x - x.mean((0, 1), keepdim=True), [(4, 40, 8)], (1,), "used past the rows a kernel loops over"),
    (lambda x: x * 2, [(4, 40, 40)], (1, 2), "changing sizes in 2 axes"),
    (lambda x: x * 2 + 1, [(0, 40, 48)], (1,), "a changing size of 0 rows"),
])  # fmt: skip
def test_what_depends_on_the_changing_size_otherwise_is_refused_with_its_reason(fn, shapes, dynamic, reason):
    """A transposed tensor (the size becomes a stride), two changing sizes, a max over rows that may be
    none, a mean over the rows (the count becomes a constant, 1/n), a batch of sequences laid out
    length-major or averaged over its rows, a size changing in two axes, a batch of no sequences
    (0·s rows): each refused, the reason said."""
    region = _region(fn, *[torch.randn(s) for s in shapes], dynamic=dynamic)
    with pytest.raises(Unsupported, match=reason):
        lower_with_runtime_rows(region)


def test_a_changing_size_read_as_an_index_keeps_the_fixed_size_rules(tmp_path):
    """``p[x.shape[0]]`` reads the size as a number, not as a size: the region is not given runtime rows
    (the lowering would have met the number where it expects an integer and raised), and under
    ``compile.strict`` nothing falls back: the sizes are read as numbers, as before."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.compile.passes.base import resolve_passes

    def fn(x, p):
        return x * 2 + p[x.shape[0]]

    table = torch.randn(512, 48)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("default"), executors=["cpp", "aten"],
                                             strict=True, cache_dir=tmp_path / "cache"))  # fmt: skip
    compiled = torch.compile(fn, backend=backend)
    for n in (5, 6, 7, 9):
        x = torch.randn(n, 48)
        torch.testing.assert_close(compiled(x, table), fn(x, table))
    assert not backend.record.fallbacks and not any(r.runtime_rows for r in backend.record.regions)
    torch._dynamo.reset()

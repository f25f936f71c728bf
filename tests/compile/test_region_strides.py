"""A compiled region's outputs have the strides eager gave the nodes (``meta["val"]``).

The graph after a region was traced against those strides: eager computes RoPE's q in the layout of
the projection, (B, T, H, D), seen as (B, H, T, D) through a transpose; the attention code transposes
it back and calls ``view``, which works only on eager's layout. A kernel writing its outputs
contiguous broke transformers' Llama and Mixtral ("view size is not compatible with input tensor's
size and stride"). Tolerance fp32 rtol 1e-5, atol 1e-6 (pointwise ops only).
"""

from __future__ import annotations

import pytest
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from accelrun.compile.codegen import cpp_build
from accelrun.compile.codegen.loop_ir import Unsupported, is_dense, lower_region, output_strides
from accelrun.compile.executors.cpp import CppExecutor
from accelrun.compile.regions import Region

pytestmark = pytest.mark.skipif(cpp_build.find_compiler() is None, reason="no g++ on this machine")


def _region(fn, *args) -> Region:
    gm = make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*args)
    ins = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    outs = [n.meta["val"] for n in gm.graph.find_nodes(op="output")[0].args[0]]
    return Region(0, gm, ins, outs)


def _rope_like(x, cos, sin):
    q = x.transpose(1, 2)  # (B, H, T, D) over a (B, T, H, D) buffer
    a, b = q[..., :8], q[..., 8:]
    return (q * cos + torch.cat((-b, a), dim=-1) * sin,)


def test_permuted_output_keeps_eager_strides_and_the_view_after_it_works(tmp_path):
    x = torch.randn(2, 8, 4, 16)
    cos, sin = torch.randn(8, 16), torch.randn(8, 16)
    (expected,) = _rope_like(x, cos, sin)
    assert not expected.is_contiguous()  # the case: eager's output is a permuted layout
    region = _region(_rope_like, x, cos, sin)
    fn = CppExecutor().compile(region, str(tmp_path))
    (got,) = fn(x, cos, sin)
    assert got.stride() == expected.stride()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # What the attention code does next, and what failed on a contiguous output.
    torch.testing.assert_close(got.transpose(1, 2).view(2, 8, 64), expected.transpose(1, 2).view(2, 8, 64))


def test_reduction_output_of_a_permuted_input_keeps_its_strides(tmp_path):
    def fn(x):
        q = x.transpose(1, 2)
        return ((q * 2.0).sum(-1, keepdim=True) + 1.0,)

    x = torch.randn(2, 8, 4, 32)
    (expected,) = fn(x)
    region = _region(fn, x)
    (got,) = CppExecutor().compile(region, str(tmp_path))(x)
    assert got.stride() == expected.stride()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_dense_and_not_dense_layouts():
    assert is_dense((2, 3, 4), (12, 4, 1))
    assert is_dense((2, 4, 3), (12, 1, 4))
    assert is_dense((2, 1, 4), (4, 99, 1))  # a size-1 axis may have any stride
    assert not is_dense((2, 4), (8, 1))  # a slice of a wider tensor
    assert not is_dense((2, 4), (0, 1))  # an expand
    with pytest.raises(Unsupported, match="not dense"):
        output_strides(torch.empty(4, 8)[:, :4], (4, 4))


def test_an_expanded_region_output_is_declined_not_written_contiguous():
    def fn(x):
        y = (x * 2.0).unsqueeze(0).expand(3, 4, 8)
        return (y, y + 1.0)

    region = _region(fn, torch.randn(4, 8))
    with pytest.raises(Unsupported):
        lower_region(region)


def test_an_expand_read_inside_and_outside_a_region_leaves_the_region_to_cpp(tmp_path):
    """transformers' Llama without its KV cache: the position ids' expand over the batch is read by
    RoPE's region and by ops outside it. Kept in the region, it was an output with a zero stride, which
    no kernel writes, so the whole RoPE region ran unfused in ATen. The readers outside now get their
    own copy of the view, and the region (writing what the expand views) goes to the C++ executor."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions

    def fn(x, y, w):
        p = (x * 2.0).unsqueeze(0).expand(4, -1)
        return (p + y).exp() * 0.5, torch.mm(p, w)

    x, y, w = torch.randn(8), torch.randn(4, 8), torch.randn(8, 3)
    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path))
    got = torch.compile(fn, backend=backend, fullgraph=True)(x, y, w)
    for g, e in zip(got, fn(x, y, w), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    regions = backend.record.regions
    assert regions and all(r.executor == "cpp" for r in regions), [(r.ops, r.declined) for r in regions]


def test_a_cast_has_a_cost_when_a_kernel_weighs_reusing_a_stored_row():
    """Whether a kernel reloads a value another loop stored or recomputes it goes by the value's cost.
    A cast has no entry in the op table (the code generators write it), and weighing one raised
    KeyError: 'cast', which declined transformers' Llama bf16 RoPE region once the expand beside it
    no longer did."""
    from accelrun.compile.codegen.loop_ir import _KernelBuilder
    from accelrun.compile.codegen.values import Input, Op

    x = Input(0, (4, 8), (8, 1), torch.bfloat16)
    cast = Op("cast", (x,), (4, 8), torch.float32, "f32")
    builder = object.__new__(_KernelBuilder)  # only its cost memo is read
    builder.costs = {}
    assert builder._cost(Op("sin", (cast,), (4, 8), torch.float32, "f32")) > builder._cost(cast) > builder._cost(x)

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

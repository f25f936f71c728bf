"""The cpu_half_gemm pass: bf16 / fp16 matrix products on a CPU without half-precision GEMM kernels run as
fp32 GEMMs. Against eager PyTorch on the same inputs, with the CPU's answer forced each way (this
project's AVX2 machines have no such kernels; CI's may). Llama blocks through the backend with the
pass: tests/compile/test_backend.py."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import accelrun.compile.passes.cpu_half_gemm as half_gemm
from accelrun.compile.passes.base import PassContext, PassOptions, registered_passes

aten, prims = torch.ops.aten, torch.ops.prims
PRODUCTS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)


@pytest.fixture
def no_half_gemm(monkeypatch):
    """This CPU as one without bf16 / fp16 GEMM kernels, whatever it has."""
    monkeypatch.setattr(half_gemm, "cpu_has_half_gemm", lambda dtype: False)


def _products(a, b, bias, batched_a, batched_b):
    return (a @ b, torch.addmm(bias, a, b), torch.bmm(batched_a, batched_b),
            torch.baddbmm(batched_a @ batched_b, batched_a, batched_b, beta=0.5, alpha=2.0))  # fmt: skip


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(24, 40), (40, 16), (16,), (3, 24, 40), (3, 40, 8)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _run_pass(gm: fx.GraphModule):
    return registered_passes()["cpu_half_gemm"].fn(gm, PassOptions(), PassContext("forward"))


def _calls(gm: fx.GraphModule, targets) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_products_become_fp32_gemms_with_eagers_results(dtype, no_half_gemm):
    inputs = _inputs(dtype)
    gm = make_fx(_products, tracing_mode="fake")(*inputs)
    result = _run_pass(gm)
    # Four products (the baddbmm's own input is a fifth, a bmm), each now on fp32 inputs.
    assert result.counts["rewritten"] == 5 and result.changed
    for node in _calls(gm, PRODUCTS):
        assert node.meta["val"].dtype == torch.float32
        assert all(a.meta["val"].dtype == torch.float32 for a in node.all_input_nodes)
    got, expected = gm(*inputs), _products(*inputs)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-2)
    # The products are exact in fp32: against an fp32 reference rounded once, at most one half ulp
    # apart (ATen's own half GEMM sums in another order, so it is only near).
    reference = [r.to(dtype) for r in _products(*(t.float() for t in inputs))]
    for g, r in zip(got, reference, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-2 if dtype == torch.bfloat16 else 1e-3, atol=0)


def test_a_cpu_with_half_gemm_and_fp32_products_are_left_alone(monkeypatch):
    monkeypatch.setattr(half_gemm, "cpu_has_half_gemm", lambda dtype: True)
    gm = make_fx(_products, tracing_mode="fake")(*_inputs(torch.bfloat16))
    assert _run_pass(gm).counts["rewritten"] == 0
    monkeypatch.setattr(half_gemm, "cpu_has_half_gemm", lambda dtype: False)
    gm = make_fx(_products, tracing_mode="fake")(*_inputs(torch.float32))
    assert _run_pass(gm).counts["rewritten"] == 0


def test_a_tensor_read_by_several_products_is_cast_once_and_odd_graphs_are_left_alone(no_half_gemm):
    a, b = _inputs(torch.bfloat16)[:2]
    gm = make_fx(lambda a, b: (a @ b, a @ b.flip(0)), tracing_mode="fake")(a, b)
    assert _run_pass(gm).counts["rewritten"] == 2
    upcasts = [n for n in _calls(gm, (aten._to_copy.default,)) if n.meta["val"].dtype == torch.float32]
    assert [u.args[0].name for u in upcasts].count("a_1") == 1  # a: one cast for both products
    # a product of mixed dtypes is ATen's to promote or refuse, and a graph without fake values (traced
    # by hand) cannot be rewritten: both left as they are
    mixed = make_fx(lambda a, b: torch.mm(a, b), tracing_mode="fake")(a, b)
    next(iter(_calls(mixed, PRODUCTS))).args[1].meta["val"] = b.float()
    assert _run_pass(mixed).counts["rewritten"] == 0
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    g.output(g.call_function(aten.mm.default, (x, y)))
    assert not _run_pass(fx.GraphModule(torch.nn.Module(), g)).changed



def _linear_backward(x, w, gy):
    """A linear layer's products in a backward: the input gradient reads the weight transposed, the weight
    gradient the input transposed; the forward reads both as they are (through a transpose and a reshape)."""
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 @ w.t()).reshape(*x.shape[:-1], -1), gy.reshape(-1, gy.shape[-1]) @ w, gy.reshape(-1, gy.shape[-1]).t() @ x2


def test_a_tensor_read_through_views_is_cast_once_and_viewed_in_fp32(no_half_gemm):
    g = torch.Generator().manual_seed(0)
    x, w, gy = (torch.randn(s, generator=g).to(torch.bfloat16) for s in [(2, 12, 40), (24, 40), (2, 12, 24)])
    gm = make_fx(_linear_backward, tracing_mode="fake")(x, w, gy)
    assert _run_pass(gm).counts["rewritten"] == 3
    upcasts = [n for n in _calls(gm, (aten._to_copy.default,)) if n.meta["val"].dtype == torch.float32]
    # One fp32 copy per tensor, not one per view of it: x (its reshape read as is and transposed), w, gy.
    assert sorted(u.args[0].name for u in upcasts) == ["gy_1", "w_1", "x_1"]
    for node in _calls(gm, PRODUCTS):
        assert all(a.meta["val"].dtype == torch.float32 for a in node.all_input_nodes)
    # No half-precision view of an input is left (the products read fp32 views); the one bf16 view
    # left reshapes a result cast back.
    half_views = [v for v in _calls(gm, half_gemm.WHOLE_VIEWS) if v.meta["val"].dtype == torch.bfloat16]
    assert [v.args[0].target for v in half_views] == [aten._to_copy.default], [v.format_node() for v in half_views]
    got, expected = gm(x, w, gy), _linear_backward(x, w, gy)
    reference = [r.to(torch.bfloat16) for r in _linear_backward(x.float(), w.float(), gy.float())]
    for out, e, r in zip(got, expected, reference, strict=True):
        assert out.dtype == torch.bfloat16 and out.shape == e.shape
        torch.testing.assert_close(out, e, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out, r, rtol=1e-2, atol=0)


def test_views_with_symbolic_sizes_are_cast_as_they_are(no_half_gemm):
    # Dynamic shapes: a reshape's sizes are nodes of the graph. Its input is not cast in its place (the
    # fp32 view would need those sizes); the view itself is, and every product still runs in fp32.
    g = torch.Generator().manual_seed(0)
    x, w, gy = (torch.randn(s, generator=g).to(torch.bfloat16) for s in [(2, 12, 40), (24, 40), (2, 12, 24)])
    gm = make_fx(_linear_backward, tracing_mode="symbolic")(x, w, gy)
    assert _run_pass(gm).counts["rewritten"] == 3
    for node in _calls(gm, PRODUCTS):
        assert all(a.meta["val"].dtype == torch.float32 for a in node.all_input_nodes)
    for out, e in zip(gm(x, w, gy), _linear_backward(x, w, gy), strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, e, rtol=1e-2, atol=1e-2)

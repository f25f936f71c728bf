"""Integer ops in fusion regions give eager's exact results (a fuzzer's findings, 2026-12-07): bits, not
truth values, for ``&``, ``|`` and ``~`` on integers; results that wrap at an 8- or 16-bit width; integer
powers past 2**53. Such ops are left to ATen; the same ops on bools and floats still fuse."""

from __future__ import annotations

import pytest
import torch

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.options import CompileOptions


def bitwise(a, b):
    return ((a & b) | (a + 1)) * 2, ~a + 1


def narrow(a, b):
    return (a * 2).sum(-1), ((a + 100) > 150).long() + 0, (b * 3 + 100) // 3


def int_pow(a, e):
    return (a + 1) ** 5, (a * 2) ** e


def masks(x, m1, m2):  # bools: logical, fused
    return ((m1 & m2) | ~m1).float() * x + 1


CASES = {
    "bitwise": (bitwise, torch.tensor([[12, 5, 7], [3, 0, 9]]), torch.tensor([10, 6, 1])),
    "narrow": (narrow, torch.tensor([[200, 100, 60, 7]], dtype=torch.uint8),
               torch.tensor([[100, -100, 50, 7]], dtype=torch.int8)),
    "int_pow": (int_pow, torch.tensor([3000, -4000, 7, 1 << 12]), torch.tensor([3, 4, 5, 2])),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_integer_results_equal_eagers_exactly(case):
    fn, *args = CASES[case]
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"]))
    got = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    for g, w in zip(got, fn(*args), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)
    assert backend.record.dynamo_graphs == 1 and not backend.record.fallbacks


def test_bitwise_ops_on_bools_still_fuse():
    x, m1, m2 = torch.randn(4, 8), torch.rand(4, 8) > 0.5, torch.rand(4, 8) > 0.5
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"]))
    got = torch.compile(masks, backend=backend, fullgraph=True)(x, m1, m2)
    torch.testing.assert_close(got, masks(x, m1, m2))
    assert backend.record.regions_per_executor().get("cpp", 0) >= 1


def test_what_moves_or_picks_narrow_integers_and_integer_squares_still_fuse():
    """The partitioner's question (``lowers``) refuses only what the kernels would get wrong: a review found
    it refusing every uint8 view and ``where``, and every integer power, ``x ** 2`` included."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from accelrun.compile.codegen.values import lowers

    def fn(a, b, i):
        return torch.where(a > 3, a.t(), b.t()), i ** 2, i.to(torch.uint8), a * 2

    a, b = (torch.randint(0, 255, (4, 4), dtype=torch.uint8) for _ in range(2))
    gm = make_fx(fn, tracing_mode="fake")(a, b, torch.arange(4))
    said = {str(n.target): lowers(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert said["aten.t.default"] and said["aten.where.self"] and said["aten.pow.Tensor_Scalar"], said
    assert not said["aten.mul.Tensor"] and not said["aten._to_copy.default"], said  # they wrap at 8 bits

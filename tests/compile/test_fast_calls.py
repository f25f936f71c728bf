"""fast_calls.runnable: the lowered graph as it runs computes exactly what the kept graph does."""

import torch
from torch import fx

from accelrun.compile.fast_calls import AS_METHODS, runnable

aten = torch.ops.aten


def test_every_retargeted_op_gives_the_same_tensor_and_views_stay_views():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    v = g.call_function(aten.view.default, (x, [4, 2, 3]))
    p = g.call_function(aten.permute.default, (v, [2, 0, 1]))  # 3 x 4 x 2
    u = g.call_function(aten.unsqueeze.default, (p, 1))  # 3 x 1 x 4 x 2
    e = g.call_function(aten.expand.default, (u, [3, 5, 4, 2]))
    s = g.call_function(aten.select.int, (e, 1, 2))  # 3 x 4 x 2
    q = g.call_function(aten.squeeze.dims, (u, [1]))
    q1 = g.call_function(aten.squeeze.dim, (u, 1))
    flat = g.call_function(aten.view.default, (x, [4, 6]))
    t = g.call_function(aten.t.default, (flat,))  # 6 x 4
    m = g.call_function(aten.mm.default, (t, w))  # 6 x 4 @ 4 x 5
    kept = g.call_function(aten.sum.dim_IntList, (m, [0]), {"keepdim": True})  # not retargeted
    g.output((s, q, q1, m, kept, e))
    gm = fx.GraphModule({}, g)
    assert {n.target for n in gm.graph.nodes if n.op == "call_function"} >= set(AS_METHODS)

    fast = runnable(gm)
    x_in, w_in = torch.randn(4, 6), torch.randn(4, 5)
    for want, got in zip(gm(x_in, w_in), fast(x_in, w_in), strict=True):
        assert torch.equal(want, got) and want.stride() == got.stride()
        assert (got.untyped_storage().data_ptr() == x_in.untyped_storage().data_ptr()) == (
            want.untyped_storage().data_ptr() == x_in.untyped_storage().data_ptr())
    assert "torch.ops.aten.view" not in fast.code and "torch.ops.aten.sum" in fast.code
    assert "torch.ops.aten.view" in gm.code  # the kept graph (dumps, graph cache) is unchanged

"""fast_calls.runnable: the lowered graph as it runs computes exactly what the kept graph does."""

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from accelrun.compile.fast_calls import AS_METHODS, STATIC_LAYOUTS, _reinterpret, layouts_are_static, runnable

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


def _traced(fn, *args):
    """``fn`` as an ATen graph whose nodes carry fake tensors (as a lowered graph's do)."""
    return make_fx(fn, tracing_mode="fake")(*args)


def _qkv_attention_like(x, w, k_cache):
    qkv = torch.mm(x.view(-1, 8), w.t()).view(2, 3, 12)
    q, k, v = qkv.split([4, 4, 4], dim=-1)
    q = q.view(2, 3, 2, 2).permute(0, 2, 1, 3)
    k = k.view(2, 3, 2, 2).permute(0, 2, 1, 3)[..., :1]
    out = (q[..., :1] * k + v.view(2, 3, 2, 2).permute(0, 2, 1, 3)[..., 1:]).sum(-1)
    k_cache.copy_(k.reshape(k_cache.shape))  # a mutation: its source view stays an op
    return out, x.view(6, 8), v  # a returned view of an input stays a view; one of an unreturned intermediate need not


def test_view_chains_become_one_reinterpretation_after_two_agreeing_calls():
    x, w, cache = torch.randn(2, 3, 8), torch.randn(12, 8), torch.zeros(2, 2, 3, 1)
    gm = _traced(_qkv_attention_like, x, w, cache)
    assert layouts_are_static(gm)
    run = runnable(gm)
    for call in range(4):
        c1, c2 = cache.clone(), cache.clone()
        want, got = gm(x, w, c1), run(x, w, c2)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b) and a.stride() == b.stride()
        assert torch.equal(c1, c2)
        assert (run.collapsed > 0) == (call >= 1)  # collapsed once the second call agreed with the first
    assert "_reinterpret_tensor" in run.code
    assert run.module.graph.find_nodes(op="output")[0].args[0][2].target is _reinterpret and "split" not in run.code
    assert run.module.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
    out_node = run.module.graph.find_nodes(op="output")[0]
    returned_x_view = out_node.args[0][1]
    assert returned_x_view.target is not _reinterpret  # x.view(6, 8) is returned: still a view op
    assert returned_x_view.args[0].op == "placeholder"


def test_no_collapse_without_fixed_layouts():
    gm = _traced(lambda x: x.view(-1).mul(2).view(2, 3).t().contiguous(), torch.randn(3, 2))
    gm.graph.find_nodes(op="placeholder")[0].meta.pop("val")  # as a graph whose sizes are unknown
    gm.meta.pop(STATIC_LAYOUTS, None)
    assert not layouts_are_static(gm)
    run = runnable(gm)
    for _ in range(3):
        assert torch.equal(run(torch.ones(3, 2)), gm(torch.ones(3, 2)))
    assert run.collapsed == 0 and "_reinterpret_tensor" not in run.code


def test_a_view_that_changes_between_calls_stays_an_op():
    """Layouts are recorded on two calls; a view the two calls saw differently is not collapsed."""
    gm = _traced(lambda x: x.view(6).mul(2).view(2, 3).t().mul(1), torch.randn(3, 2))
    run = runnable(gm)
    run(torch.randn(3, 2))
    first = dict(run._records[0])
    run._records[0] = {k: (v[0], v[1], v[2] + 1) for k, v in first.items()}  # as if the offsets moved
    run(torch.randn(3, 2))
    assert run.collapsed == 0
    x = torch.randn(3, 2)
    assert torch.equal(run(x), gm(x))


def test_constants_read_only_by_non_aliasing_ops_are_made_once():
    def fn(x):
        zero = torch.ops.aten.scalar_tensor.default(0.0)  # read by where: made once
        pos = torch.arange(4, dtype=torch.float32)  # returned: made on every call
        grid = torch.full((2, 4), 3.0)  # viewed: made on every call
        return torch.where(x > 0, x, zero) + pos, pos, grid.t()

    gm = _traced(fn, torch.randn(2, 4))
    run = runnable(gm)
    outs = []
    for _ in range(3):
        x = torch.randn(2, 4)
        want, got = gm(x), run(x)
        outs.append(got)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
    assert run.hoisted == 1 and "scalar_tensor" not in run.code
    assert "arange" in run.code and "full" in run.code
    outs[1][1].add_(1)  # a caller changing a returned tensor changes no later call
    assert torch.equal(run(torch.ones(2, 4))[1], torch.arange(4.0))


def test_a_reshape_is_collapsed_only_where_it_did_not_copy():
    g = fx.Graph()
    x = g.placeholder("x")
    flat = g.call_function(aten.reshape.default, (g.call_function(aten.mul.Tensor, (x, 2)), [-1]))  # a view
    copied = g.call_function(aten.reshape.default, (g.call_function(aten.t.default, (x,)), [-1]))  # a copy
    g.output((g.call_function(aten.add.Tensor, (flat, 1)), g.call_function(aten.add.Tensor, (copied, 1))))
    gm = fx.GraphModule({}, g)
    gm.meta[STATIC_LAYOUTS] = True  # as the lowering finds for a graph of fixed sizes
    run = runnable(gm)
    for _ in range(3):
        x = torch.randn(3, 4)
        for a, b in zip(gm(x), run(x), strict=True):
            assert torch.equal(a, b)
    reshapes = run.module.graph.find_nodes(op="call_function", target=aten.reshape.default)
    assert len(reshapes) == 1 and reshapes[0].args[0].args[0].op == "placeholder"  # the copying one, of x.t()
    assert run.collapsed == 2  # the other reshape, and the t()


def _aten_backend(tmp_path, passes="none"):
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.compile.passes.base import resolve_passes

    torch._dynamo.reset()
    return AccelrunBackend(CompileOptions(passes=resolve_passes(passes), executors=["aten"], cache_dir=tmp_path))


def test_as_strided_counts_its_offset_from_the_storage_so_it_is_never_collapsed(tmp_path):
    fn = lambda x: x.as_strided((2, 3), (3, 1), 2) * 10  # noqa: E731
    compiled, big = torch.compile(fn, backend=_aten_backend(tmp_path)), torch.arange(20.0)
    for _ in range(3):
        compiled(big[:12])
    x = big[4:16]  # same sizes and strides, another storage offset: Dynamo does not recompile
    assert torch.equal(compiled(x), fn(x))


def test_a_saved_view_chain_of_a_parameter_keeps_autograd_s_version_check(tmp_path):
    """The forward saves permute(view(w)): the whole chain stays views of w, so changing w in place
    before the backward raises as in eager (a reinterpretation would not notice)."""
    w = torch.randn(2, 4, 4, requires_grad=True)
    compiled = torch.compile(lambda x, w: x @ w.view(8, 4).t(), backend=_aten_backend(tmp_path))
    for _ in range(3):
        compiled(torch.randn(3, 4, requires_grad=True), w).sum().backward()
    y = compiled(torch.randn(3, 4, requires_grad=True), w)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_returned_view_of_a_returned_tensor_stays_its_view(tmp_path):
    def fn(y):
        c = y * 3
        return c, c.view(-1)[2:]

    compiled = torch.compile(fn, backend=_aten_backend(tmp_path))
    for _ in range(4):
        c, d = compiled(torch.ones(2, 3))
        assert d._base is c
        before = c._version
        d.add_(1)
        assert c._version > before and c.view(-1)[2:].eq(4).all()


def test_a_backward_graph_s_returned_views_are_collapsed():
    """A backward returns gradients, which autograd only adds up: no version counter or _base to keep.
    Elsewhere a returned view of another returned tensor stays its view."""
    def fn(g, x):
        m = g.t().mm(x)
        return m, m.view(2, 4, 4).permute(0, 2, 1)

    gm = _traced(fn, torch.randn(3, 8), torch.randn(3, 4))
    g, x = torch.randn(3, 8), torch.randn(3, 4)
    forward_like, backward_like = runnable(gm), runnable(gm, returns_gradients=True)
    for _ in range(3):
        for run in (forward_like, backward_like):
            for got, want in zip(run(g, x), gm(g, x), strict=True):
                assert torch.equal(got, want) and got.stride() == want.stride()
    assert forward_like.collapsed == 1  # g.t() only: the returned chain stays views of m
    assert backward_like.collapsed == 2  # and the returned chain, as one reinterpretation

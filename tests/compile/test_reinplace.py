"""The ``reinplace`` pass, and the ``simplify`` rules that feed it: a mixture's gradients (rows put into
zeros, then added up) and ``index_add`` chains run in place on tensors only the graph sees, at
eager's values; what anything else reads is never written."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import PassContext, PassOptions
from accelrun.compile.passes.reinplace import reinplace

aten = torch.ops.aten


def _traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _run(fn, args):
    gm = _traced(fn, *args)
    want = gm(*args)
    result = reinplace(gm, PassOptions(), PassContext(graph_kind="backward"))
    got = gm(*args)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b)
    return gm, result


def test_a_write_into_zeros_made_in_the_graph_runs_in_place():
    def fn(idx, v):
        return aten.index_put(torch.zeros(8, 4), [idx], v, True)

    gm, result = _run(fn, (torch.tensor([1, 3, 1]), torch.randn(3, 4)))
    assert result.counts == {"rewritten": 1, "own_base": 0}
    assert aten.index_put_.default in _targets(gm) and aten.index_put.default not in _targets(gm)


def test_writers_of_one_shared_zeros_each_get_their_own():
    """cse merges equal zeros: each writer then needs a tensor of its own, or the second would add
    into the first's result."""

    def fn(i, j, v, w):
        zeros = torch.zeros(8, 4)
        return aten.index_put(zeros, [i], v, True) + aten.index_put(zeros, [j], w, True)

    args = (torch.tensor([0, 2]), torch.tensor([2, 5]), torch.randn(2, 4), torch.randn(2, 4))
    gm = _traced(fn, *args)
    (zeros,) = [n for n in gm.graph.nodes if n.target in (aten.zeros.default, aten.full.default)]
    assert len(zeros.users) == 2
    want = gm(*args)
    result = reinplace(gm, PassOptions(), PassContext(graph_kind="backward"))
    torch.testing.assert_close(gm(*args), want)
    assert result.counts == {"rewritten": 2, "own_base": 1}


def test_what_anything_else_reads_is_never_written():
    """An input (a parameter, the caller's tensor), and a written tensor the graph also returns, keep
    their values: those writes stay copies. Zeros the graph also returns stay zeros: the write gets
    zeros of its own."""

    def from_input(base, idx, v):
        return aten.index_put(base, [idx], v, True)

    def zeros_returned(idx, v):
        zeros = torch.zeros(8, 4)
        return zeros, aten.index_put(zeros, [idx], v, True)

    def written_returned(idx, v):
        once = aten.index_put(torch.zeros(8, 4), [idx], v, True)
        return once, aten.index_put(once, [idx], v, True)

    idx, v = torch.tensor([1, 3]), torch.randn(2, 4)
    base = torch.randn(8, 4)
    kept = base.clone()
    gm, result = _run(from_input, (base, idx, v))
    assert result.counts["rewritten"] == 0 and torch.equal(base, kept)
    gm, result = _run(zeros_returned, (idx, v))  # _run: every output as before the pass
    assert result.counts == {"rewritten": 1, "own_base": 1}
    gm, result = _run(written_returned, (idx, v))
    assert result.counts == {"rewritten": 1, "own_base": 0}  # the first write; the second reads a returned one

    def after_a_write_into_the_input(base, idx, v):  # the first write is the caller's tensor, written
        return aten.index_put(aten.index_put_(base, [idx], v, True), [idx], v, True)

    gm = _traced(after_a_write_into_the_input, base.clone(), idx, v)
    assert reinplace(gm, PassOptions(), PassContext(graph_kind="backward")).counts["rewritten"] == 0


def test_an_index_add_chain_as_a_mixture_writes_it_runs_in_place_at_eagers_values(tmp_path):
    """``out = out.index_add(0, rows_e, y_e)`` per expert, rows read from the data: forward in place on
    one tensor, backward's gradient rows added into the input's gradient without a tensor of zeros
    per expert (simplify's add rule), every write in place, at eager's values and gradients."""

    def mixture(x, w, choice):
        out = torch.zeros_like(x)
        for e in range(3):
            rows = torch.where(choice == e)[0]
            out = out.index_add(0, rows, torch.tanh(x[rows] @ w[e]))
        return out * x

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 16, generator=g), torch.randn(3, 16, 16, generator=g)
    choice = torch.randint(0, 3, (64,), generator=g)
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path / "cache", strict=True))
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(mixture, backend=backend, fullgraph=True)(xc, w, choice)
    want = mixture(xe, w, choice)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-5)
    fired = {(p.graph.rsplit(".", 1)[1], p.name): p.counts for p in backend.record.passes
             if p.name in ("reinplace", "simplify")}  # fmt: skip
    assert fired["forward", "reinplace"]["rewritten"] == 3, fired
    assert fired["backward", "simplify"].get("add_of_scattered_zeros", 0) >= 2, fired
    assert fired["backward", "reinplace"]["rewritten"] >= 2, fired
    torch._dynamo.reset()


def test_an_add_laid_out_unlike_the_write_that_would_replace_it_is_kept():
    """``a + scattered`` takes its layout from both (here a's transposed one, which the view after it
    relies on); the write into ``a`` would lay it out as ``a``'s base: the add stays."""
    from accelrun.compile.passes.simplify import simplify

    def fn(a, idx, v):
        s = aten.index_put(torch.full((4, 5), 0.0), [idx], v, True)
        return (a + s).t().view(-1)

    args = (torch.randn(5, 4).t(), torch.tensor([0, 2]), torch.randn(2, 5))
    gm = _traced(fn, *args)
    want = gm(*args)
    result = simplify(gm, PassOptions(), PassContext(graph_kind="backward"))
    assert "add_of_scattered_zeros" not in result.counts, result.counts
    torch.testing.assert_close(gm(*args), want)


def test_what_a_rewritten_add_leaves_unread_is_removed_once():
    """Both operands of the add read one tensor of zeros (a scatter into it, and a view of it): the
    add's rewrite leaves the scatter, then the zeros, unread; each is removed once."""
    from accelrun.compile.passes.simplify import simplify

    def fn(a, idx, v):
        zeros = torch.full((8, 4), 0.0)
        return (a + zeros.view(8, 4)) + aten.index_put(zeros, [idx], v, True)

    args = (torch.randn(8, 4), torch.tensor([1, 5]), torch.randn(2, 4))
    gm = _traced(fn, *args)
    want = gm(*args)
    result = simplify(gm, PassOptions(), PassContext(graph_kind="backward"))
    assert result.counts.get("add_of_scattered_zeros") == 1, result.counts
    torch.testing.assert_close(gm(*args), want)

"""The region partitioner and extract/replace: no cycles, the rules hold, and numerics are unchanged.

Random DAGs of pointwise ops, reductions, matmuls and views (hypothesis) check that the graph of
regions is acyclic and that cutting regions out and calling them back gives bit-identical outputs.
"""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from accelrun.compile.extract import FUSED_REGION_KEY, extract_regions, region_boundary, replace_regions
from accelrun.compile.op_kinds import node_kind
from accelrun.compile.passes.base import PassContext, registered_passes
from accelrun.compile.passes.partition_regions import PartitionRegionsOptions, compute_ops, partition
from accelrun.compile.regions import REGION_KEY, regions_of

aten = torch.ops.aten
N = 4  # every tensor is (N, N), (N, 1) or (1, N)


# --- random programs -------------------------------------------------------------------------------

# One step: (op name, operand picks). Operands index into the values made so far (modulo their count).
_STEP = st.tuples(
    st.sampled_from(["neg", "sigmoid", "tanh", "add", "mul", "sub", "sum_last", "amax_last", "sum_first",
                     "permute", "view_same", "expand", "mm", "clone"]),
    st.integers(0, 1000), st.integers(0, 1000),
)  # fmt: skip


def _run_program(steps, outputs, *inputs):
    vals = list(inputs)
    for op, i, j in steps:
        a, b = vals[i % len(vals)], vals[j % len(vals)]
        full = [v for v in vals if tuple(v.shape) == (N, N)]
        if op == "neg":
            v = aten.neg.default(a)
        elif op == "sigmoid":
            v = aten.sigmoid.default(a)
        elif op == "tanh":
            v = aten.tanh.default(a)
        elif op == "add":
            v = aten.add.Tensor(a, b)
        elif op == "mul":
            v = aten.mul.Tensor(a, b)
        elif op == "sub":
            v = aten.sub.Tensor(a, b)
        elif op == "sum_last":
            v = aten.sum.dim_IntList(a, [-1], True)
        elif op == "amax_last":
            v = aten.amax.default(a, [-1], True)
        elif op == "sum_first":
            v = aten.sum.dim_IntList(a, [0], True)
        elif op == "permute":
            v = aten.permute.default(a, [1, 0])
        elif op == "view_same":
            v = aten.view.default(aten.clone.default(a), list(a.shape))
        elif op == "expand":
            v = aten.expand.default(a, [N, N])
        elif op == "clone":
            v = aten.clone.default(a)
        else:  # mm of two square values, if there are any
            if not full:
                continue
            v = aten.mm.default(full[i % len(full)], full[j % len(full)])
        vals.append(v)
    return tuple(vals[k % len(vals)] for k in outputs) + (vals[-1],)


def _traced(steps, outputs):
    inputs = (torch.randn(N, N), torch.randn(N, 1), torch.randn(1, N))
    gm = make_fx(lambda x, y, z: _run_program(steps, outputs, x, y, z))(*inputs)
    return gm, inputs


# --- checks ----------------------------------------------------------------------------------------


def _assert_quotient_acyclic(gm: fx.GraphModule) -> None:
    """Contract each region to one vertex; the result must be a DAG (Kahn's algorithm empties it)."""
    unit = {n: ("r", n.meta[REGION_KEY]) if REGION_KEY in n.meta else n for n in gm.graph.nodes}
    edges = {(unit[i], unit[n]) for n in gm.graph.nodes for i in n.all_input_nodes if unit[i] != unit[n]}
    vertices = set(unit.values())
    indeg = {v: 0 for v in vertices}
    for _, b in edges:
        indeg[b] += 1
    ready = [v for v in vertices if indeg[v] == 0]
    seen = 0
    while ready:
        v = ready.pop()
        seen += 1
        for a, b in edges:
            if a == v:
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
    assert seen == len(vertices), "the graph of regions has a cycle"


def _assert_region_rules(gm: fx.GraphModule, max_nodes: int, min_ops: int) -> None:
    for rid, nodes in regions_of(gm).items():
        members = set(nodes)
        assert len(nodes) <= max_nodes
        assert compute_ops(nodes) >= min_ops
        reductions = set()
        for n in nodes:
            assert n.op == "call_function" and node_kind(n) != "other", n.format_node()
            if node_kind(n) == "view":  # views between members, or of an outside tensor read only inside
                read_inside = [u in members for u in n.users]
                assert any(read_inside) and (n.args[0] in members or all(read_inside)), n.format_node()
            if node_kind(n) == "reduction":
                reductions.add((tuple(n.args[0].meta["val"].shape), tuple(n.args[1])))
        assert len({shape for shape, _ in reductions}) <= 1, f"region {rid} reduces several shapes {reductions}"
        if len(reductions) > 1:  # a row sum and a column sum of one shape (a norm's backward)
            for shape, dims in reductions:
                n, k = len(shape), len(dims)
                assert sorted(d % n for d in dims) in (list(range(k)), list(range(n - k, n))), reductions


def _replace_with_plain_calls(gm: fx.GraphModule) -> fx.GraphModule:
    return replace_regions(gm, {r.id: r.gm.forward for r in extract_regions(gm)})


def _assert_same_outputs(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(steps=st.lists(_STEP, min_size=1, max_size=18), outputs=st.lists(st.integers(0, 1000), max_size=3),
       max_nodes=st.sampled_from([2, 3, 5, 64]), min_ops=st.sampled_from([1, 2]))  # fmt: skip
def test_random_dags_stay_acyclic_and_keep_numerics(steps, outputs, max_nodes, min_ops):
    gm, inputs = _traced(steps, outputs)
    expected = gm(*inputs)
    partition(gm.graph, max_nodes=max_nodes, min_ops=min_ops)
    _assert_quotient_acyclic(gm)
    _assert_region_rules(gm, max_nodes, min_ops)
    new = _replace_with_plain_calls(gm)
    assert not any(REGION_KEY in n.meta for n in new.graph.nodes if n.op == "call_function"
                   and n.target is not operator.getitem)  # fmt: skip
    _assert_same_outputs(expected, new(*inputs))


# --- hand-written cases ----------------------------------------------------------------------------


def _graph_of(fn, *inputs) -> fx.GraphModule:
    return make_fx(fn)(*inputs)


def test_three_regions_that_would_close_a_cycle_through_each_other():
    # a1 -> b1 -> ... -> a2 through other regions: merging into A must be refused even though no
    # single node path leaves A and comes back through plain nodes.
    def f(x):
        a1 = x.sin() * 2
        b1 = (a1 @ x).cos() * 3  # leaves A through a matmul
        c1 = (b1 @ x).exp() + 1
        return (c1 @ x) * a1  # back into A's neighbourhood

    gm = _graph_of(f, torch.randn(4, 4))
    partition(gm.graph, min_ops=1)
    _assert_quotient_acyclic(gm)
    assert not any(REGION_KEY in n.meta for n in gm.graph.nodes if n.target is aten.mm.default)


def test_a_path_through_another_region_counts_even_without_a_node_path():
    # B = {tanh, cos, add}. a1 -> mm -> cos enters B; B leaves from tanh -> mm -> n. No chain of
    # nodes leads from a1 to n, but merging n into A would make A -> B -> A once B runs as one call.
    def f(x, y):
        a1 = x.sin() * 2
        b2 = y.tanh()
        b1 = (a1 @ x).cos()
        b3 = b1 + b2
        n = (b2 @ x) * a1
        return b3, n

    gm = _graph_of(f, torch.randn(4, 4), torch.randn(4, 4))
    partition(gm.graph)
    region = {n.name: n.meta.get(REGION_KEY) for n in gm.graph.nodes}
    assert region["tanh"] == region["cos"] == region["add"] is not None
    assert region["mul"] is not None and region["mul_1"] != region["mul"]
    _assert_quotient_acyclic(gm)


def test_a_running_sum_of_products_is_not_one_region_at_the_end():
    """A sum fed by a product per step (the chunked head and loss's weight gradient under autocast: a
    bf16 part per chunk summed in fp32) grew into one region at the end that held every part until
    then. A merge is refused where the parts it keeps waiting outweigh the sum it saves. Two steps with
    nothing opaque between stay one region."""

    def running_sum(x, *ws):
        total = (x @ ws[0]).float()
        for w in ws[1:]:
            total = total + (x @ w)  # bf16 part, fp32 sum
        return total * 0.5

    x = torch.randn(512, 64, dtype=torch.bfloat16)
    ws = [torch.randn(64, 1024, dtype=torch.bfloat16) for _ in range(6)]  # 1 MiB parts, 2 MiB sums
    gm = _graph_of(running_sum, x, *ws)
    partition(gm.graph, min_ops=1)
    adds = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    assert len(adds) == 5
    regions = [n.meta.get(REGION_KEY) for n in adds]
    # a region holds no more parts than twice what its sum would have kept across the products
    assert max(regions.count(r) for r in set(regions)) <= 3 and len(set(regions)) >= 2, regions
    _assert_quotient_acyclic(gm)

    def no_gap(a, b, c):
        return ((a + b) * c).float() + 1

    gm = _graph_of(no_gap, *(torch.randn(1024, 1024) for _ in range(3)))
    assert len(partition(gm.graph, min_ops=1)) == 1


def test_softmax_and_rmsnorm_are_one_region_each():
    def f(x, w):
        e = (x - x.amax(-1, keepdim=True)).exp()  # softmax as its decomposition spells it
        p = e / e.sum(-1, keepdim=True)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        return p, y

    gm = _graph_of(f, torch.randn(8, 16), torch.randn(16))
    regions = partition(gm.graph)
    kinds = [sorted({n.target.__name__.split(".")[0] for n in nodes if node_kind(n) == "reduction"})
             for nodes in regions.values()]  # fmt: skip
    assert len(regions) == 2, regions
    assert kinds == [["amax", "sum"], ["mean"]]


def test_row_and_column_sums_of_one_shape_share_a_region_others_split():
    gm = _graph_of(lambda x: x.exp().sum(0, keepdim=True) * x.exp().sum(1, keepdim=True), torch.randn(4, 5))
    assert len(partition(gm.graph, min_ops=1)) == 1  # the norm-backward shape: one region, two loops
    _assert_region_rules(gm, 64, 1)
    # A middle axis and a trailing one of one shape: split (the loop IR has no loop for both).
    gm = _graph_of(lambda x: x.exp().sum(1, keepdim=True) * x.exp().sum(2, keepdim=True), torch.randn(3, 4, 5))
    regions = partition(gm.graph, min_ops=1)
    _assert_region_rules(gm, 64, 1)
    _assert_quotient_acyclic(gm)
    assert len(regions) >= 2


def test_input_views_read_only_inside_join_and_output_views_stay_outside():
    def f(x, y):
        a = (x.view(4, 4) * 2).exp()  # a view of an input read only by a member: joins (index arithmetic)
        b = (a.t() + 1).clone(memory_format=torch.contiguous_format)  # t() is between two members
        yv = y.view(4, 4)  # read by a member and returned: stays outside, the region reads it
        return b.view(16), b + yv, yv  # b.view(16) is after the last member: stays outside

    gm = _graph_of(f, torch.randn(16), torch.randn(16))
    (nodes,) = partition(gm.graph).values()
    views = {n.args[0].name if n.args[0].op == "placeholder" else n.target for n in nodes if node_kind(n) == "view"}
    assert views in ({"x_1", aten.t.default}, {"x_1", aten.permute.default}), views
    outside = [n for n in gm.graph.nodes if node_kind(n) == "view" and n not in nodes]
    assert {n.args[0].name for n in outside} == {"y_1", "clone"}, [n.format_node() for n in outside]


def test_a_view_of_an_output_read_inside_and_outside_is_viewed_outside_not_written_twice():
    """A linear's input gradient: returned flat, viewed for the residual and summed through the view
    for the bias. The region writes the flat tensor once; the reader outside views it (as eager's
    does) instead of the region writing the view's elements as a second output. The numerics stay."""

    def f(a, b):
        s = a + b
        shaped = s.view(4, 8, 16)
        return s @ torch.ones(16, 3), shaped.sum((0, 1)), shaped.cumsum(1)  # cumsum: outside any region

    inputs = torch.randn(32, 16), torch.randn(32, 16)
    gm = _graph_of(f, *inputs)
    expected = gm(*inputs)
    (nodes,) = partition(gm.graph, min_ops=1).values()
    (region,) = extract_regions(gm)
    assert [tuple(m.shape) for m in region.output_meta] == [(32, 16), (16,)], region.output_meta
    (outside,) = [n for n in gm.graph.nodes if node_kind(n) == "view" and n not in nodes
                  and n.args[0] in nodes]  # fmt: skip
    assert tuple(outside.meta["val"].shape) == (4, 8, 16)
    gm.recompile()
    _assert_same_outputs(gm(*inputs), expected)


def test_min_ops_and_max_nodes():
    gm = _graph_of(lambda x: (x.sin() @ x).cos(), torch.randn(4, 4))
    assert partition(gm.graph, min_ops=2) == {}
    gm = _graph_of(lambda x: x.sin().cos().exp().neg().tanh(), torch.randn(4, 4))
    sizes = sorted(len(v) for v in partition(gm.graph, max_nodes=2, min_ops=1).values())
    assert sizes == [1, 2, 2]


def test_extract_region_signature_and_metadata():
    def f(x, y):
        s = (x * y).sin()
        return s + 1, s.sum(-1)

    gm = _graph_of(f, torch.randn(3, 5), torch.randn(5))
    partition(gm.graph)
    (region,) = extract_regions(gm, graph_kind="backward")
    assert region.graph_kind == "backward"
    assert region.input_names == ("x_1", "y_1")
    assert [tuple(m.shape) for m in region.input_meta] == [(3, 5), (5,)]
    assert [tuple(m.shape) for m in region.output_meta] == [(3, 5), (3,)]
    placeholders = [n for n in region.gm.graph.nodes if n.op == "placeholder"]
    assert all("val" in n.meta for n in region.gm.graph.nodes if n.op != "output")
    assert [n.name for n in placeholders] == ["x_1", "y_1"]
    x, y = torch.randn(3, 5), torch.randn(5)
    out = region.gm(x, y)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out[0], (x * y).sin() + 1)
    assert "mul" in region.describe()


def test_replace_regions_reorders_when_an_outside_user_sits_between_members():
    # Region {a, c}: b (a matmul, outside) uses a and sits between them in graph order; c does not
    # depend on b. The fused call must come before b.
    def f(x):
        a = x.sin() * 2
        b = a @ x
        c = (a + 1).exp()
        return b, c

    gm = _graph_of(f, torch.randn(4, 4))
    regions = partition(gm.graph, min_ops=1)
    assert len(regions) == 1
    inputs, outputs = region_boundary(next(iter(regions.values())))
    assert [n.name for n in inputs] == ["x_1"]
    new = _replace_with_plain_calls(gm)
    fused = [n for n in new.graph.nodes if FUSED_REGION_KEY in n.meta]
    assert len(fused) == 1 and fused[0].name.startswith("region_")
    x = torch.randn(4, 4)
    _assert_same_outputs(gm(x), new(x))


def test_replace_regions_leaves_unlisted_regions_and_rejects_unknown_ids():
    gm = _graph_of(lambda x: (x.sin() * 2 @ x).cos() + 1, torch.randn(4, 4))
    regions = partition(gm.graph, min_ops=1)
    assert len(regions) == 2
    first = min(regions)
    new = replace_regions(gm, {first: extract_regions(gm)[0].gm.forward})
    assert sum(FUSED_REGION_KEY in n.meta for n in new.graph.nodes) == 1
    x = torch.randn(4, 4)
    _assert_same_outputs(gm(x), new(x))
    with pytest.raises(KeyError, match="no region with id"):
        replace_regions(gm, {99: lambda *a: a})


def test_registered_pass_summary_and_counts():
    spec = registered_passes()["partition_regions"]
    gm = _graph_of(lambda x: (x - x.amax(-1, keepdim=True)).exp() @ x, torch.randn(4, 4))
    result = spec.fn(gm, PartitionRegionsOptions(), PassContext("forward"))
    assert spec.stage == "post_grad"
    assert result.summary == "formed 1 regions over 3 ops"
    assert result.counts["regions"] == 1
    # with views between the ops, the nodes the region table lists are said too
    gm = _graph_of(lambda x: (x.t() - x.amax(0)).exp().t() @ x, torch.randn(4, 4))
    result = spec.fn(gm, PartitionRegionsOptions(), PassContext("forward"))
    ops, nodes = result.counts["ops"], result.counts["nodes"]
    assert nodes > ops and result.summary.endswith(f"over {ops} ops ({nodes} with the views between them)"), \
        result.summary


def test_an_op_the_code_generators_cannot_lower_stays_out_of_the_regions():
    # atan2 is pointwise, but the loop IR has no rule for it: inside a region it would make the C++ and
    # Triton generators decline the whole region; outside, the ops around it still fuse and compile.
    from accelrun.compile.codegen.loop_ir import cached_program
    from accelrun.compile.codegen.values import lowers

    gm = _graph_of(lambda x, y: ((x * 2 + 1).atan2(y).exp() * 3).sum(-1), torch.randn(8, 16), torch.randn(8, 16))
    (atan2,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.atan2.default]
    assert node_kind(atan2) == "pointwise" and not lowers(atan2)
    regions = partition(gm.graph, min_ops=2)
    assert len(regions) == 2 and REGION_KEY not in atan2.meta  # before it (mul, add) and after it (exp, mul, sum)
    for region in extract_regions(gm):
        cached_program(region)  # every region lowers: none sent back to ATen for one op

"""The communication passes on synthetic graphs: FSDP-like forward (parameter all-gathers) and
backward (gradient reduce-scatters) ATen graphs traced with a one-rank gloo group.

Invariants: the result is a valid graph; no collective's result is read before its wait; every
node still comes after what it reads; buckets hold at most ``bucket_mb``; in-flight bytes stay under
``max_inflight_mb``; and the graph computes the same values (with one rank, the collectives are
identities, so any reordering or bucketing mistake shows as a different result).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from accelrun.compile.passes.base import PassContext
from accelrun.compile.passes.bucket_collectives import BucketOptions, bucket_collectives
from accelrun.compile.passes.schedule_overlap import ScheduleOptions, schedule_overlap
from accelrun.compile.schedule import (
    check_schedule,
    inflight_peak,
    is_collective,
    is_wait,
    kind,
    nbytes,
    schedule_summary,
    timeline,
)

c10d = torch.ops._c10d_functional
LAYERS, DIM = 6, 32


@pytest.fixture(scope="module")
def group_name():
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    if ours and dist.is_initialized():
        dist.destroy_process_group()


def _forward(group: str):
    def forward(x, *shards):
        for w in shards:  # gather, wait at once, use: what a traced FSDP forward looks like
            full = c10d.wait_tensor(c10d.all_gather_into_tensor(w, 1, group))
            x = torch.relu(x @ full.T) + x
        return x

    return forward


def _backward(group: str):
    def backward(g, *acts):
        grads = []
        for a in reversed(acts):  # each layer's weight gradient, reduce-scattered at once
            gw = g.T @ a
            grads.append(c10d.wait_tensor(c10d.reduce_scatter_tensor(gw / 1, "sum", 1, group)))
            g = g * torch.sigmoid(a) + 1
        return (g, *grads)

    return backward


def _trace(f, n_extra: int, shape=None):
    shape = shape or ((DIM, DIM) if f.__name__ == "forward" else (8, DIM))
    torch.manual_seed(0)
    inputs = [torch.randn(8, DIM), *[torch.randn(*shape) * 0.1 for _ in range(n_extra)]]
    return make_fx(f, tracing_mode="fake")(*inputs), inputs


def _positions(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _check_order(gm):
    check_schedule(gm)
    pos = _positions(gm)
    for n in gm.graph.nodes:
        assert all(pos[i] < pos[n] for i in n.all_input_nodes), n  # dependencies respected
        if is_collective(n):
            for w in n.users:  # read only through its wait, and the wait's users come after it
                assert is_wait(w) and all(pos[u] > pos[w] for u in w.users)


def _same_result(before, after, inputs):
    want, got = before(*inputs), after(*inputs)
    want, got = (want if isinstance(want, (tuple, list)) else [want]), (got if isinstance(got, (tuple, list)) else [got])
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_schedule_overlap_issues_early_waits_late_and_stays_valid(group_name, graph):
    f = _forward(group_name) if graph == "forward" else _backward(group_name)
    gm, inputs = _trace(f, LAYERS)
    reference, _ = _trace(f, LAYERS)
    assert schedule_summary(gm)["waited_at_once"] == LAYERS
    result = schedule_overlap(gm, ScheduleOptions(max_inflight_mb=1024), PassContext(graph))
    _check_order(gm)
    s = schedule_summary(gm)
    assert s["collectives"] == LAYERS
    # Forward: every gather but the first is issued before the previous layer computes; backward:
    # every reduce-scatter but the last has the following layers' compute to hide behind.
    assert s["waited_at_once"] <= 1, (result.summary, timeline(gm))
    _same_result(reference, gm, inputs)


@pytest.mark.parametrize("limit_kib", [4, 8, 12])
def test_schedule_overlap_keeps_inflight_bytes_under_the_bound(group_name, limit_kib):
    gm, inputs = _trace(_forward(group_name), LAYERS)
    reference, _ = _trace(_forward(group_name), LAYERS)
    one = 2 * DIM * DIM * 4  # input + output of one gather: 8 KiB
    limit = max(limit_kib * 1024, one)
    schedule_overlap(gm, ScheduleOptions(max_inflight_mb=limit / 2**20), PassContext("forward"))
    _check_order(gm)
    assert inflight_peak(gm) <= limit
    _same_result(reference, gm, inputs)


@pytest.mark.parametrize("graph", ["forward", "backward"])
@pytest.mark.parametrize("bucket_kib", [4, 8, 1000])
def test_bucket_collectives_respects_the_bound_and_keeps_values(group_name, graph, bucket_kib):
    f = _forward(group_name) if graph == "forward" else _backward(group_name)
    gm, inputs = _trace(f, LAYERS)
    reference, _ = _trace(f, LAYERS)
    limit = bucket_kib * 1024
    result = bucket_collectives(gm, BucketOptions(bucket_mb=limit / 2**20), PassContext(graph))
    gm.graph.lint()
    _check_order(gm)
    colls = [n for n in gm.graph.nodes if is_collective(n)]
    one = DIM * DIM * 4
    for c in colls:  # a bucket holds at most the bound (a single larger collective stays alone)
        b = nbytes(c.args[0].meta["val"])
        assert b <= max(limit, one), (b, limit)
        assert c.args[0].meta["val"].dtype == torch.float32
    expected = LAYERS if limit < 2 * one else -(-LAYERS // (limit // one))
    assert len(colls) == expected, result.summary
    _same_result(reference, gm, inputs)
    # Then scheduled: still valid, same values.
    schedule_overlap(gm, ScheduleOptions(), PassContext(graph))
    _check_order(gm)
    _same_result(reference, gm, inputs)


def test_buckets_never_merge_a_collective_with_one_it_depends_on(group_name):
    def chained(x, w):
        a = c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))
        b = c10d.wait_tensor(c10d.all_reduce(a * 2, "sum", group_name))  # needs a's result
        c = c10d.wait_tensor(c10d.all_reduce(w, "sum", group_name))
        return b + c.sum()

    gm, inputs = _trace(chained, 1, shape=(8, DIM))
    reference, _ = _trace(chained, 1, shape=(8, DIM))
    bucket_collectives(gm, BucketOptions(bucket_mb=100), PassContext("forward"))
    _check_order(gm)
    kinds = [kind(n) for n in gm.graph.nodes if is_collective(n)]
    assert len(kinds) == 2  # a with c in one bucket; b (after a) alone
    _same_result(reference, gm, inputs)


def test_timeline_shows_issues_waits_and_compute(group_name):
    gm, _ = _trace(_forward(group_name), 2)
    before = timeline(gm)
    assert "▶ all_gather_into_tensor#0" in before and "◀ wait #0 (exposed)" in before
    schedule_overlap(gm, ScheduleOptions(), PassContext("forward"))
    after = timeline(gm)
    assert "ops overlap it" in after and "compute" in after

"""Merge small collectives of one kind, group and dtype into buckets of at most ``bucket_mb``.

Each collective costs a fixed latency besides its bytes; a block's dozen parameter all-gathers (or
gradient reduce-scatters) cost a dozen latencies. A bucket concatenates its members' inputs, runs one
collective, and splits the result into what each member's wait used to give:

- ``all_gather_into_tensor``: inputs flattened and concatenated (N elements); the gathered (G, N)
  result is sliced per member and reshaped to (G·rows, ...), the member's own gathered shape;
- ``reduce_scatter_tensor``: each input viewed as (G, n/G) (rank r's slice is row r), concatenated
  along columns, so rank r's part of the bucket is every member's part for r; the (N/G,) result is
  sliced per member;
- ``all_reduce``: inputs flattened, concatenated, reduced, sliced.

Members are taken in graph order; a collective joins an open bucket only if its input does not
depend on the result of a collective already in it (that would make a cycle). The bucket is issued
where its last input is ready and waited where its first result is needed; ``schedule_overlap``
then moves issue and wait.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from accelrun.compile.passes.base import PassContext, PassResult, register_pass
from accelrun.compile.schedule import WAIT, held_bytes, is_collective, kind, nbytes, stable_toposort, wait_of
from accelrun.config.compile_names import BucketOptions
from accelrun.torch_private import detect_fake_mode

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BUCKETABLE = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _key(c: fx.Node) -> tuple | None:
    k = kind(c)
    if k not in BUCKETABLE or wait_of(c) is None:
        return None
    val = c.args[0].meta.get("val") if isinstance(c.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return (k, *[a for a in c.args[1:]], val.dtype)


def _descendants(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def plan_buckets(gm: fx.GraphModule, limit_bytes: int) -> list[list[fx.Node]]:
    """Groups of collectives (graph order) to merge; singletons are left out."""
    open_: dict[tuple, list[fx.Node]] = {}
    reach: dict[tuple, set[fx.Node]] = {}
    size: dict[tuple, int] = defaultdict(int)
    done: list[list[fx.Node]] = []
    for n in gm.graph.nodes:
        if not is_collective(n):
            continue
        key = _key(n)
        if key is None:
            continue
        b = nbytes(n.args[0].meta["val"])
        bucket = open_.get(key)
        fits = bucket is not None and size[key] + b <= limit_bytes and n.args[0] not in reach[key] and n not in reach[key]
        if not fits:
            if bucket is not None:
                done.append(bucket)
            open_[key], reach[key], size[key] = [], set(), 0
        open_[key].append(n)
        size[key] += b
        reach[key] |= _descendants([wait_of(n)])
    done.extend(open_.values())
    return [b for b in done if len(b) > 1]


def _acyclic_when_merged(gm: fx.GraphModule, buckets: list[list[fx.Node]]) -> bool:
    """Whether merging every bucket at once keeps the graph acyclic (buckets of different kinds could
    wait on each other)."""
    unit: dict[fx.Node, object] = {n: n for n in gm.graph.nodes}
    for i, members in enumerate(buckets):
        for c in members:
            unit[c], unit[wait_of(c)] = ("issue", i), ("wait", i)
    deps: dict[object, set] = defaultdict(set)
    for n in gm.graph.nodes:
        deps[unit[n]] |= {unit[i] for i in n.all_input_nodes if unit[i] != unit[n]}
    users: dict[object, set] = defaultdict(set)
    for u, ds in deps.items():
        for d in ds:
            users[d].add(u)
    waiting = {u: len(deps[u]) for u in set(unit.values())}
    ready = [u for u, k in waiting.items() if k == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for v in users[u]:
            waiting[v] -= 1
            if waiting[v] == 0:
                ready.append(v)
    return seen == len(waiting)


class _Builder:
    """Inserts nodes with their fake values (later passes and executors read ``meta['val']``)."""

    def __init__(self, gm: fx.GraphModule, before: fx.Node) -> None:
        self.graph = gm.graph
        self.before = before
        vals = [n.meta.get("val") for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.fake_mode = detect_fake_mode(vals)

    def __call__(self, target, *args) -> fx.Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args)
        real = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        real = [[x.meta["val"] if isinstance(x, fx.Node) else x for x in a] if isinstance(a, list) else a
                for a in real]  # fmt: skip
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*real)
        return node


def _merge(gm: fx.GraphModule, members: list[fx.Node], priority: dict[fx.Node, float]) -> None:
    first = members[0]
    k = kind(first)
    rest_args = list(first.args[1:])
    waits = [wait_of(c) for c in members]
    inputs = [c.args[0] for c in members]
    vals = [i.meta["val"] for i in inputs]
    out_vals = [w.meta["val"] for w in waits]
    build = _Builder(gm, waits[0])
    issue_at = max(priority[c] for c in members)
    wait_at = min(priority[w] for w in waits)
    new: list[tuple[fx.Node, float]] = []

    def add(target, *args, at: float) -> fx.Node:
        node = build(target, *args)
        new.append((node, at))
        return node

    if k == "reduce_scatter_tensor":
        group_size = first.args[2]
        parts = [add(aten.view.default, x, [group_size, v.numel() // group_size], at=issue_at)
                 for x, v in zip(inputs, vals, strict=True)]  # fmt: skip
        cat = add(aten.cat.default, parts, 1, at=issue_at)
        flat = add(aten.view.default, cat, [-1], at=issue_at)
    else:
        parts = [add(aten.view.default, x, [v.numel()], at=issue_at) for x, v in zip(inputs, vals, strict=True)]
        flat = add(aten.cat.default, parts, at=issue_at)
    coll = add(first.target, flat, *rest_args, at=issue_at)
    wait = add(WAIT, coll, at=wait_at)
    offset = 0
    if k == "all_gather_into_tensor":
        group_size = first.args[1]
        total = sum(v.numel() for v in vals)
        grid = add(aten.view.default, wait, [group_size, total], at=wait_at)
    for w, v, ov in zip(waits, vals, out_vals, strict=True):
        n = v.numel()
        if k == "all_gather_into_tensor":
            piece = add(aten.slice.Tensor, grid, 1, offset, offset + n, at=wait_at)
            offset += n
        else:
            m = ov.numel()
            piece = add(aten.slice.Tensor, wait, 0, offset, offset + m, at=wait_at)
            offset += m
        # A copy of its own per member: members' results must not alias each other (they may be graph
        # outputs, e.g. gradients, that later code updates in place).
        own = add(aten.clone.default, piece, at=wait_at)
        out = add(aten.view.default, own, list(ov.shape), at=wait_at)
        w.replace_all_uses_with(out)
    for w, c in zip(waits, members, strict=True):
        gm.graph.erase_node(w)
        gm.graph.erase_node(c)
    for node, at in new:
        priority[node] = at


@register_pass("bucket_collectives", "post_grad", BucketOptions)
def bucket_collectives(gm: fx.GraphModule, options: BucketOptions, ctx: PassContext) -> PassResult:
    """Merge collectives of one kind, group and dtype into buckets of at most bucket_mb."""
    buckets = plan_buckets(gm, int(options.bucket_mb * 2**20))
    if not buckets:
        return PassResult(False, "no collectives to merge")
    if not _acyclic_when_merged(gm, buckets):
        return PassResult(False, "left alone: merging these collectives would make them wait on each other")
    before = sum(1 for n in gm.graph.nodes if is_collective(n))
    priority = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    largest = 0
    lines = [f"bucket {i}: {len(b)} × {kind(b[0])} ({', '.join(c.args[0].name for c in b)})"
             for i, b in enumerate(buckets)]  # fmt: skip
    for members in buckets:
        largest = max(largest, sum(held_bytes(c) - nbytes(c.meta.get("val")) for c in members))
        _merge(gm, members, priority)
    stable_toposort(gm, priority)
    gm.recompile()
    after = sum(1 for n in gm.graph.nodes if is_collective(n))
    merged = sum(len(b) for b in buckets)
    return PassResult(True, f"{merged} collectives → {len(buckets)} buckets ({before} → {after} collectives)",
                      {"buckets": len(buckets), "merged": merged, "largest_bucket_bytes": largest},
                      detail="\n".join(lines))

"""Issue each collective as early as its inputs allow, wait as late as its first use allows, and keep
the bytes held by collectives in flight under ``max_inflight_mb``.

The compute nodes keep their order. Collectives keep theirs too (every rank must issue them in the
same order, and does: it runs the same graph). A collective is issued, with the nodes that only
prepare its input (padding, concatenation of a bucket, the gradient's pre-division), before the
first compute node at which its inputs are ready and the in-flight bound leaves room for it; its
wait goes just before the first node that reads the result. When compute needs a collective that
has not been issued (its turn came and the bound was full), the oldest collectives in flight are
waited for until it fits, then it is issued and waited. In a whole-model forward graph this
prefetches the next blocks' parameters while the current block computes, as far as the bound
allows; in the backward graph each gradient's reduce-scatter starts as soon as the gradient exists
and is waited for at the end.
"""

from __future__ import annotations

from collections import deque

from torch import fx

from accelrun.compile.passes.base import PassContext, PassResult, register_pass
from accelrun.compile.schedule import (
    held_bytes,
    inflight_peak,
    is_collective,
    is_wait,
    reorder,
    side_by_side,
    spans,
    timeline,
)
from accelrun.config.compile_names import ScheduleOptions


def _prep_nodes(gm: fx.GraphModule, colls: set[fx.Node]) -> set[fx.Node]:
    """Nodes whose results go only into collectives (directly or through other such nodes)."""
    prep: set[fx.Node] = set()
    for n in reversed(gm.graph.nodes):
        if n.op != "call_function" or n in colls or is_wait(n) or not n.users:
            continue
        if all(u in colls or u in prep for u in n.users):
            prep.add(n)
    return prep


def plan_schedule(gm: fx.GraphModule, limit_bytes: int) -> list[fx.Node]:
    nodes = list(gm.graph.nodes)
    colls = [n for n in nodes if is_collective(n)]
    coll_set = set(colls)
    prep = _prep_nodes(gm, coll_set)
    waits_of = {c: [u for u in c.users if is_wait(u)] for c in colls}
    compute = [n for n in nodes if n not in coll_set and n not in prep and not is_wait(n)]
    order: list[fx.Node] = []
    done: set[fx.Node] = set()
    pending = deque(colls)
    inflight: dict[fx.Node, int] = {}  # collective → bytes, in issue order

    def emit(n: fx.Node) -> None:
        done.add(n)
        order.append(n)

    def closure(c: fx.Node) -> tuple[list[fx.Node], set[fx.Node]]:
        """The not-yet-emitted prep nodes of ``c`` (topological) and the other nodes they need."""
        seen: set[fx.Node] = set()
        need: set[fx.Node] = set()
        todo = [i for i in c.all_input_nodes]
        while todo:
            n = todo.pop()
            if n in done or n in seen:
                continue
            if n in prep:
                seen.add(n)
                todo.extend(n.all_input_nodes)
            else:
                need.add(n)
        return [n for n in nodes if n in seen], need

    def retire(c: fx.Node) -> None:
        inflight.pop(c)
        for w in waits_of[c]:
            if w not in done:
                emit(w)

    def issue_next() -> None:
        c = pending.popleft()
        b = held_bytes(c)
        while inflight and sum(inflight.values()) + b > limit_bytes:
            retire(next(iter(inflight)))
        chain, need = closure(c)
        for n in need:
            ensure(n)
        for n in chain:
            emit(n)
        emit(c)
        inflight[c] = b

    def ensure(target: fx.Node) -> None:
        """Emit ``target`` and whatever it needs (iteratively: graphs are deep)."""
        stack = [target]
        while stack:
            n = stack[-1]
            if n in done:
                stack.pop()
                continue
            if is_wait(n):
                c = n.args[0]
                if c not in done:
                    while c not in done:
                        issue_next()
                    continue
                stack.pop()
                inflight.pop(c, None)
                emit(n)
                continue
            if n in coll_set:
                while n not in done:
                    issue_next()
                stack.pop()
                continue
            missing = [i for i in n.all_input_nodes if i not in done]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            emit(n)

    def ready(c: fx.Node) -> bool:
        _, need = closure(c)
        return all(n in done for n in need)

    for n in compute:
        if n.op != "placeholder":
            # Issue early: every collective whose turn has come, whose inputs are ready and that fits.
            while pending and ready(pending[0]) and (
                not inflight and held_bytes(pending[0]) <= limit_bytes
                or sum(inflight.values()) + held_bytes(pending[0]) <= limit_bytes
            ):
                issue_next()
        ensure(n)
    for c in list(pending):
        ensure(c)
    for n in nodes:  # waits nobody reads (kept: they complete the collective)
        if n not in done:
            ensure(n)
    return order


@register_pass("schedule_overlap", "post_grad", ScheduleOptions)
def schedule_overlap(gm: fx.GraphModule, options: ScheduleOptions, ctx: PassContext) -> PassResult:
    """Issue collectives early and wait late, with at most max_inflight_mb in flight."""
    if not any(is_collective(n) for n in gm.graph.nodes):
        return PassResult(False, "no collectives")
    before = spans(gm)
    before_text = timeline(gm)
    limit = int(options.max_inflight_mb * 2**20)
    order = plan_schedule(gm, limit)
    reorder(gm, order)
    gm.recompile()
    after = spans(gm)
    exposed_before = sum(1 for s in before if s.ops_between == 0)
    exposed_after = sum(1 for s in after if s.ops_between == 0)
    return PassResult(
        True,
        f"{len(after)} collectives: waited at once {exposed_before} → {exposed_after}; ops overlapping them "
        f"{sum(s.ops_between for s in before)} → {sum(s.ops_between for s in after)}; "
        f"peak in flight {inflight_peak(gm) / 2**20:.2f} MiB",
        {"collectives": len(after), "waited_at_once": exposed_after,
         "ops_between_issue_and_wait": sum(s.ops_between for s in after), "inflight_peak_bytes": inflight_peak(gm)},
        detail=side_by_side("before", before_text, "after", timeline(gm)),
    )  # fmt: skip

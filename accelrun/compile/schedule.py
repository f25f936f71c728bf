"""Collectives in an ATen graph: what they are, how far each one's wait is from its issue, how many
bytes are in flight, and the schedule as a readable timeline (``accelrun compile explain``).

A functional collective is an issue node (``_c10d_functional.all_gather_into_tensor`` and kin) whose
result is read through one ``_c10d_functional.wait_tensor`` node. Between the two, the collective runs
in the background; compute placed between them hides its time.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

WAIT = torch.ops._c10d_functional.wait_tensor.default


def is_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is WAIT


def is_collective(n: fx.Node) -> bool:
    """An issue node of a functional collective (not its wait)."""
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "_c10d_functional" and n.target is not WAIT)  # fmt: skip


def kind(n: fx.Node) -> str:
    return n.target.overloadpacket.__name__  # type: ignore[union-attr]


def wait_of(c: fx.Node) -> fx.Node | None:
    waits = [u for u in c.users if is_wait(u)]
    return waits[0] if len(waits) == 1 and len(c.users) == 1 else None


def nbytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(nbytes(v) for v in val)
    return 0


def held_bytes(c: fx.Node) -> int:
    """Memory a collective holds while in flight: its input and its output buffer."""
    return sum(nbytes(i.meta.get("val")) for i in c.all_input_nodes) + nbytes(c.meta.get("val"))


def inflight_peak(gm: fx.GraphModule) -> int:
    """The most bytes held by issued, not yet waited collectives at any point of the graph's order."""
    live: dict[fx.Node, int] = {}
    peak = 0
    for n in gm.graph.nodes:
        if is_collective(n):
            live[n] = held_bytes(n)
            peak = max(peak, sum(live.values()))
        elif is_wait(n):
            live.pop(n.args[0], None)
    return peak


def check_schedule(gm: fx.GraphModule) -> None:
    """Raise unless every collective's result is read only through its wait, and only after it."""
    gm.graph.lint()  # definitions before uses
    for n in gm.graph.nodes:
        if is_collective(n) and any(not is_wait(u) for u in n.users):
            raise AssertionError(f"{n.name}: a collective's result is used without its wait")


def reorder(gm: fx.GraphModule, order: list[fx.Node]) -> None:
    """Put the graph's nodes in ``order`` (a topological order of all of them)."""
    nodes = list(gm.graph.nodes)
    if len(order) != len(nodes) or set(order) != set(nodes):
        raise AssertionError("reorder: the new order must hold every node once")
    prev = order[0]
    if prev is not nodes[0]:
        nodes[0].prepend(prev)
    for n in order[1:]:
        prev.append(n)
        prev = n


def stable_toposort(gm: fx.GraphModule, priority: dict[fx.Node, float]) -> None:
    """Reorder into a topological order that follows ``priority`` (then the current order) where it can."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(priority.get(n, index[n]), index[n], n.name) for n in nodes if waiting[n] == 0]
    by_name = {n.name: n for n in nodes}
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        *_, name = heapq.heappop(ready)
        n = by_name[name]
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (priority.get(u, index[u]), index[u], u.name))
    if len(order) != len(nodes):
        raise AssertionError("stable_toposort: the graph has a cycle")
    # The output node stays last, placeholders first (FX expects both).
    order.sort(key=lambda n: {"placeholder": 0, "output": 2}.get(n.op, 1))
    reorder(gm, order)


# -- the timeline ----------------------------------------------------------------------------------------


@dataclass
class CollectiveSpan:
    id: int
    kind: str
    bytes: int
    issue: int  # position (compute ops before it)
    wait: int
    ops_between: int  # compute ops between issue and wait: what can hide it


def _is_compute(n: fx.Node) -> bool:
    return (n.op == "call_function" and not is_collective(n) and not is_wait(n)
            and n.target is not operator.getitem)  # fmt: skip


def spans(gm: fx.GraphModule) -> list[CollectiveSpan]:
    out: dict[fx.Node, CollectiveSpan] = {}
    ops = 0
    for n in gm.graph.nodes:
        if is_collective(n):
            out[n] = CollectiveSpan(len(out), kind(n), held_bytes(n) - nbytes(n.meta.get("val")), ops, -1, 0)
        elif is_wait(n) and n.args[0] in out:
            s = out[n.args[0]]
            s.wait, s.ops_between = ops, ops - s.issue
        elif _is_compute(n):
            ops += 1
    return list(out.values())


def schedule_summary(gm: fx.GraphModule) -> dict[str, int]:
    ss = spans(gm)
    return {
        "collectives": len(ss),
        "waited_at_once": sum(1 for s in ss if s.ops_between == 0),
        "ops_between_issue_and_wait": sum(s.ops_between for s in ss),
        "inflight_peak_bytes": inflight_peak(gm),
    }


def _size(b: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b} B"


def timeline(gm: fx.GraphModule, max_lines: int = 80) -> str:
    """The graph's schedule, one line per compute segment or collective event::

        ▶ all_gather_into_tensor#0 16.0 KiB
          compute 12 ops
        ◀ wait #0 (12 ops overlap it)
    """
    lines: list[str] = []
    ids: dict[fx.Node, int] = {}
    issued_at: dict[fx.Node, int] = {}
    ops = seg = 0
    for n in gm.graph.nodes:
        if _is_compute(n):
            ops += 1
            seg += 1
            continue
        if (is_collective(n) or is_wait(n)) and seg:
            lines.append(f"  compute {seg} ops")
            seg = 0
        if is_collective(n):
            ids[n] = len(ids)
            issued_at[n] = ops
            lines.append(f"▶ {kind(n)}#{ids[n]} {_size(held_bytes(n) - nbytes(n.meta.get('val')))}")
        elif is_wait(n) and n.args[0] in ids:
            c = n.args[0]
            between = ops - issued_at[c]
            lines.append(f"◀ wait #{ids[c]} ({between} ops overlap it)" if between else f"◀ wait #{ids[c]} (exposed)")
    if seg:
        lines.append(f"  compute {seg} ops")
    if len(lines) > max_lines:
        half = max_lines // 2
        lines = [*lines[:half], f"  … {len(lines) - max_lines} lines …", *lines[-half:]]
    return "\n".join(lines)


def side_by_side(left_title: str, left: str, right_title: str, right: str) -> str:
    """Two texts as columns (the schedule before and after a pass)."""
    a, b = left.splitlines(), right.splitlines()
    width = max([len(left_title), *map(len, a)]) + 3
    rows = [f"{left_title:<{width}}{right_title}", f"{'-' * len(left_title):<{width}}{'-' * len(right_title)}"]
    rows += [f"{x:<{width}}{y}" for x, y in zip(a + [""] * (len(b) - len(a)), b + [""] * (len(a) - len(b)),
                                                 strict=True)]  # fmt: skip
    return "\n".join(rows)

"""How much of a model ran compiled: Dynamo's frames, the frames it skipped and why, graph breaks.

A backend only sees the graphs Dynamo hands it. A frame Dynamo gives up on (a data-dependent branch
inside a loop over layers: "graph break in loop ... frame skipped") never reaches the backend and
runs eagerly; its graph break is not even counted under ``counters["graph_break"]``, only under
``counters["unimplemented"]``. Without this a record said "0 Dynamo graph(s), 0 graph break(s)" for a
model that ran entirely in eager. Dynamo's counters are process-wide and only grow, so a backend
snapshots them when it is made and reports the difference.
"""

from __future__ import annotations

import re
from typing import Any

from accelrun.compile import break_sites
from accelrun.torch_private import dynamo_counters as counters

_WATCHED = ("frames", "unimplemented", "graph_break")
# The title of Dynamo's reason when it gives up recompiling (torch 2.13; "cache limit" in older ones).
RECOMPILE_LIMIT = ("Dynamo recompile limit exceeded", "Dynamo cache limit exceeded")
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_SKIPPED = re.compile(r"frame skipped: (\S+) \((\S+) line (\d+)\)")


def snapshot() -> dict[str, dict[str, int]]:
    """Dynamo's counters now (what a new backend compares against later), and how many break sites
    had been logged."""
    return {**{k: dict(counters[k]) for k in _WATCHED}, "break_sites": {"n": break_sites.logged()}}


def since(start: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for k in _WATCHED:
        base = start.get(k, {})
        out[k] = {reason: n - base.get(reason, 0) for reason, n in counters[k].items() if n > base.get(reason, 0)}
    return out


def forget_since(start: dict[str, dict[str, int]]) -> None:
    """Put Dynamo's counters back to ``start``: what a trace that never ran counted (the graph cache's
    refused precompile, traced again by its torch.compile fallback) is not counted twice."""
    break_sites.forget_after(start.get("break_sites", {}).get("n", 0))
    for k in _WATCHED:
        base = start.get(k, {})
        for reason in list(counters[k]):
            if reason in base:
                counters[k][reason] = base[reason]
            else:
                del counters[k][reason]


def skipped_frames(start: dict[str, dict[str, int]]) -> list[tuple[str, int, str]]:
    """The frames Dynamo skipped since ``start``: (file, the line its function starts at, the reason)."""
    out = []
    for reason in since(start)["unimplemented"]:
        if where := _SKIPPED.search(reason):
            _, path, line = where.groups()
            out.append((path, int(line), _short(reason)))
    return out


def _short(reason: str) -> str:
    """A Dynamo reason's title and where it happened: "Data-dependent branching (model.py:12)"."""
    first = reason.strip().splitlines()[0] if reason.strip() else "unknown"
    where = _FILE_LINE.search(reason)
    return f"{first} ({break_sites.path_tail(where.group(1))}:{where.group(2)})" if where else first


RAN_EAGERLY = " ran eagerly: "  # between a skipped frame's place and Dynamo's reason (``frames_skipped``)


def dynamo_coverage(start: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Frames Dynamo saw and compiled since ``start``, the frames it skipped (function, file:line, why)
    and the graph breaks it could not trace through, each reason with its file:line."""
    delta = since(start)
    frames = delta["frames"]
    skipped: list[str] = []
    unsupported: dict[str, int] = {}
    for reason, n in delta["unimplemented"].items():
        where = _SKIPPED.search(reason)
        if where:
            fn, path, line = where.groups()
            skipped.append(f"{fn} ({break_sites.path_tail(path)}:{line}){RAN_EAGERLY}{_short(reason)}")
        else:
            unsupported[_short(reason)] = unsupported.get(_short(reason), 0) + n
    return {
        "frames_seen": frames.get("total", 0),
        "frames_compiled": frames.get("ok", 0),
        "frames_skipped": skipped,
        "unsupported": unsupported,  # graph breaks by title and file:line (what Dynamo could not trace)
        # where each graph break happened, and what avoids it
        "break_sites": [site.line() for site in break_sites.since(start.get("break_sites", {}).get("n", 0))],
    }


def graph_breaks_since(start: dict[str, dict[str, int]], coverage: dict[str, Any] | None = None) -> dict[str, int]:
    """Graph breaks by reason since ``start``. Dynamo counts a break at a branch on a tensor's value only
    among its "unimplemented" reasons (torch 2.13), not its graph breaks: without those a model split
    in two by an `if` said "graph breaks 0". ``coverage``: ``dynamo_coverage(start)``, if at hand."""
    unsupported = (coverage or dynamo_coverage(start))["unsupported"]
    breaks: dict[str, int] = {}
    # Titles (with file:line where the reason has one), as for what Dynamo could not trace: torch's own
    # hints stay out (for `.item()` it suggests tracing the host read, where the warning says what avoids it).
    for why, n in since(start)["graph_break"].items():
        breaks[_short(why)] = breaks.get(_short(why), 0) + n
    for why, n in unsupported.items():
        if not why.startswith(RECOMPILE_LIMIT):
            breaks[why] = breaks.get(why, 0) + n
    return breaks


def coverage_warnings(record: Any) -> list[str]:
    """Warnings for a record: nothing compiled, frames skipped, graph breaks."""
    d = record.dynamo or {}
    out = []
    seen = d.get("frames_seen", 0)
    if record.graphs_in_use() == 0:  # graphs loaded from the graph cache ran compiled too
        why = f" (Dynamo saw {seen} frame(s) and compiled none)" if seen else " (Dynamo saw no frame of it)"
        out.append(f"nothing was compiled: the model ran in eager PyTorch{why}; {_what_to_change(d)}")
    breaks = sum(record.graph_breaks.values())
    # What a skipped frame calls is traced on its own (a block's forward): say so, or the warning reads
    # as if nothing ran compiled beside the run line's graphs. What avoids the break is said once: by
    # the graph-break line below, or with nothing compiled by the line above.
    apart = " (what it calls was traced apart, into the run's graphs)" if record.graphs_in_use() else ""
    for line in d.get("frames_skipped", []):
        fix = break_sites.known_fix(_reason_of_skip(line)) if record.graphs_in_use() and not breaks else None
        where, _, why = line.partition(RAN_EAGERLY)
        out.append(f"Dynamo skipped a frame: {where}{RAN_EAGERLY.rstrip(': ')}{apart}: {why}"
                   + (f"; to avoid it: {fix}" if fix else ""))
    limits = sum(n for why, n in d.get("unsupported", {}).items() if why.startswith(RECOMPILE_LIMIT))
    if limits:
        out.append(f"Dynamo hit its recompile limit ×{limits}: a compiled function met more kinds of input or "
                   "module than torch._dynamo.config.recompile_limit allows, and the calls beyond it ran eagerly "
                   "(blocks that differ per instance compile once each: compile.scope = model compiles the "
                   "forward once; a size that changes from call to call, as a mixture of experts' tokens per "
                   "expert, compiles three times at most, for its first value, its next, and then any, unless "
                   "the code branches on it: torch's own warning names what changed)")
    if breaks and record.graphs_in_use():  # with nothing compiled, the warning above says why
        sites = d.get("break_sites") or []
        where = f": {'; '.join(sites[:2])}" + (f" (+{len(sites) - 2} more)" if len(sites) > 2 else "") if sites else ""
        out.append(f"{breaks} graph break(s): the model runs as several graphs with eager code between them{where}")
    return out


def _reason_of_skip(line: str) -> str:
    """Dynamo's reason in a ``frames_skipped`` line ("forward (m.py:8) ran eagerly: <reason>"); a reason
    of another kind as it is."""
    return line.partition(RAN_EAGERLY)[2] or line


def _what_to_change(dynamo: dict[str, Any]) -> str:
    reasons = [*dynamo.get("unsupported", {}), *dynamo.get("frames_skipped", [])]
    if reasons:
        first = reasons[0]
        more = f" (+{len(reasons) - 1} more in report.md)" if len(reasons) > 1 else ""
        return f"Dynamo could not trace: {first}{more}; " + (
            break_sites.untraceable_advice(first) or break_sites.known_fix(_reason_of_skip(first)) or (
            "move that code (a branch on a tensor's value, a boolean mask) out of the compiled forward, or into "
            "a module of its own"))
    return ("compile.scope = model compiles the whole forward; a module whose code is torch.nn's own "
            "compiles only when called from the model's forward")


def coverage_lines(record: Any) -> list[str]:
    """For ``accelrun compile explain``: how much ran compiled, then the warnings."""
    d = record.dynamo or {}
    regions = len(record.regions)
    claimed = sum(1 for r in record.regions if r.executor != "aten")
    lines = [f"Dynamo frames: {d.get('frames_seen', 0)} seen, {d.get('frames_compiled', 0)} compiled into "
             f"{record.dynamo_graphs} graph(s)"
             + (f" (+ {record.graphs_loaded()} loaded from the graph cache)" if record.graphs_loaded() else "")
             + f"; {sum(record.graph_breaks.values())} graph break(s); "
             f"fusion regions: {claimed} of {regions} compiled, "
             f"{sum(g.left_to_aten for g in record.graphs)} op(s) outside regions run as ATen calls"]
    lines += [f"  not traced ×{n}: {why}" for why, n in d.get("unsupported", {}).items()]
    lines += [f"warning: {w}" for w in record.warnings()]
    return lines

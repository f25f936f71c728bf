"""How much of a model ran compiled: Dynamo's frames, the frames it skipped and why, graph breaks.

A backend only sees the graphs Dynamo hands it. A frame Dynamo gives up on (a data-dependent branch
inside a loop over layers: "graph break in loop ... frame skipped") never reaches the backend and
runs eagerly; its graph break is not even counted under ``counters["graph_break"]``, only under
``counters["unimplemented"]``. Without this a record said "0 Dynamo graph(s), 0 graph break(s)" for a
model that ran entirely in eager. Dynamo's counters are process-wide and only grow, so a backend
snapshots them when it is made and reports the difference.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelrun.torch_private import dynamo_counters as counters

_WATCHED = ("frames", "unimplemented", "graph_break")
# The title of Dynamo's reason when it gives up recompiling (torch 2.13; "cache limit" in older ones).
RECOMPILE_LIMIT = ("Dynamo recompile limit exceeded", "Dynamo cache limit exceeded")
_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_SKIPPED = re.compile(r"frame skipped: (\S+) \((\S+) line (\d+)\)")


# -- where each graph break happened --------------------------------------------------------------
# Dynamo's counters key a graph break by its reason, which names no place. Dynamo also logs each break
# with the user's stack on its ``graph_breaks`` artifact logger (printed only under TORCH_LOGS), so
# accelrun listens there, without printing, while a model compiles.

# Places inside torch.nn where a model written the usual way breaks the graph, with what avoids it:
# (file's tail, function) -> the change.
KNOWN_BREAKS: dict[tuple[str, str], str] = {
    ("modules/transformer.py", "_detect_is_causal_mask"): (
        "pass is_causal=True beside the causal mask (tgt_is_causal=True to a decoder; torch.nn's Transformer "
        "modules otherwise compare the mask with a causal one on the host, every call)"
    ),
}
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_BREAK_PLACE = re.compile(r"in user code at (\S+:\d+)")
_ATTRIBUTED = re.compile(r'File "([^"]+)", line (\d+)\s*$', re.MULTILINE)  # a place with no function


@dataclass(frozen=True)
class BreakSite:
    """One graph break: the user's line that led to it, the function it happened in, and the change
    that avoids it where it is a known one."""

    user_line: str  # "mylm.py:14", the innermost frame outside torch
    inside: str  # "transformer.py:1245 in _detect_is_causal_mask", the innermost frame ("" if the user's)
    fix: str = ""

    def line(self) -> str:
        where = f"at {self.user_line}" + (f" (in torch's {self.inside})" if self.inside else "")
        return where + (f"; to avoid it: {self.fix}" if self.fix else "")


def break_site(message: str) -> BreakSite | None:
    """The site of a break from Dynamo's graph-break log message. Its "User code traceback" can leave
    out the frame Dynamo began tracing in (the user's forward, when the break is in a module it
    calls); its "source attribution" names the user's line then, so that line is preferred."""
    frames = [(path.replace("\\", "/"), line, fn) for path, line, fn in _FRAME.findall(message)]
    if not frames:
        return None
    attributed = [(p.replace("\\", "/"), line) for p, line in _ATTRIBUTED.findall(message)]
    user = [f[:2] for f in frames if not _machinery(f[0])]
    user_line = next((f for f in reversed(attributed) if not _machinery(f[0])), user[-1] if user else frames[-1][:2])
    path, line, fn = frames[-1]
    inner = f"{_tail(path)}:{line} in {fn}" if _machinery(path) else ""
    fix = next((why for (tail, name), why in KNOWN_BREAKS.items() if path.endswith(tail) and fn == name), "")
    return BreakSite(f"{_tail(user_line[0])}:{user_line[1]}", inner, fix)


_ACCELRUN = Path(__file__).resolve().parents[1].as_posix() + "/"


def _machinery(path: str) -> bool:
    """torch's frames, and accelrun's own that call the model (not its built-in models' code)."""
    if "/torch/" in path or "/click/" in path:  # torch, and accelrun's command line
        return True
    return path.startswith(_ACCELRUN) and not path.startswith(_ACCELRUN + "models/families/")


class _BreakListener(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sites: list[BreakSite] = []
        # Dynamo logs a break it has logged before without its stack, by the place it broke at.
        self._by_place: dict[str, BreakSite] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            place = _BREAK_PLACE.search(message)
            site = break_site(message) or (self._by_place.get(place.group(1)) if place else None)
            if site is not None:
                self.sites.append(site)
                if place:
                    self._by_place[place.group(1)] = site
        except Exception:  # a message of another shape: the break still counts, without its place
            pass


class _NoItemHint(logging.Filter):
    """Dynamo's own warning for `Tensor.item()` (16 lines, and a hint to trace the host read rather than
    to avoid it): the report gives the break's place and, where known, the change instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).lstrip().startswith("Graph break from `Tensor.item()`")


_listener: _BreakListener | None = None


def listen_for_break_sites() -> None:
    """From now on in this process, record where graph breaks happen (idempotent). TORCH_LOGS's own
    printing of them, where a user asked for it, stays as it was."""
    global _listener
    if _listener is not None:
        return
    from accelrun.torch_private import dynamo_frame_break_log, dynamo_graph_break_log, dynamo_tensor_log

    _listener = _BreakListener()
    for log in (dynamo_graph_break_log, dynamo_frame_break_log):
        if not log.isEnabledFor(logging.DEBUG):  # not asked for by TORCH_LOGS: keep it off the console
            log.setLevel(logging.DEBUG)
            log.propagate = False
        log.addHandler(_listener)
    dynamo_tensor_log.addFilter(_NoItemHint())


def snapshot() -> dict[str, dict[str, int]]:
    """Dynamo's counters now (what a new backend compares against later), and how many break sites
    had been logged."""
    return {**{k: dict(counters[k]) for k in _WATCHED}, "break_sites": {"n": _sites_logged()}}


def _sites_logged() -> int:
    return len(_listener.sites) if _listener is not None else 0


def break_sites_since(start: dict[str, Any]) -> list[BreakSite]:
    """Break sites logged since ``start``, each once."""
    if _listener is None:
        return []
    return list(dict.fromkeys(_listener.sites[start.get("break_sites", {}).get("n", 0):]))


def since(start: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for k in _WATCHED:
        base = start.get(k, {})
        out[k] = {reason: n - base.get(reason, 0) for reason, n in counters[k].items() if n > base.get(reason, 0)}
    return out


def forget_since(start: dict[str, dict[str, int]]) -> None:
    """Put Dynamo's counters back to ``start``: what a trace that never ran counted (the graph cache's
    refused precompile, traced again by its torch.compile fallback) is not counted twice."""
    if _listener is not None:
        del _listener.sites[start.get("break_sites", {}).get("n", 0):]
    for k in _WATCHED:
        base = start.get(k, {})
        for reason in list(counters[k]):
            if reason in base:
                counters[k][reason] = base[reason]
            else:
                del counters[k][reason]


def _short(reason: str) -> str:
    """A Dynamo reason's title and where it happened: "Data-dependent branching (model.py:12)"."""
    first = reason.strip().splitlines()[0] if reason.strip() else "unknown"
    where = _FILE_LINE.search(reason)
    return f"{first} ({_tail(where.group(1))}:{where.group(2)})" if where else first


def _tail(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


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
            skipped.append(f"{fn} ({_tail(path)}:{line}) ran eagerly: {_short(reason)}")
        else:
            unsupported[_short(reason)] = unsupported.get(_short(reason), 0) + n
    return {
        "frames_seen": frames.get("total", 0),
        "frames_compiled": frames.get("ok", 0),
        "frames_skipped": skipped,
        "unsupported": unsupported,  # graph breaks by title and file:line (what Dynamo could not trace)
        "break_sites": [site.line() for site in break_sites_since(start)],  # where, and what avoids it
    }


def coverage_warnings(record: Any) -> list[str]:
    """Warnings for a record: nothing compiled, frames skipped, graph breaks."""
    d = record.dynamo or {}
    out = []
    seen = d.get("frames_seen", 0)
    if record.graphs_in_use() == 0:  # graphs loaded from the graph cache ran compiled too
        why = f" (Dynamo saw {seen} frame(s) and compiled none)" if seen else " (Dynamo saw no frame of it)"
        out.append(f"nothing was compiled: the model ran in eager PyTorch{why}; {_what_to_change(d)}")
    for line in d.get("frames_skipped", []):
        out.append(f"Dynamo skipped a frame: {line}")
    limits = sum(n for why, n in d.get("unsupported", {}).items() if why.startswith(RECOMPILE_LIMIT))
    if limits:
        out.append(f"Dynamo hit its recompile limit ×{limits}: a compiled function met more kinds of input or "
                   "module than torch._dynamo.config.recompile_limit allows, and the calls beyond it ran eagerly "
                   "(blocks that differ per instance compile once each); compile.scope = model compiles the "
                   "forward once")
    breaks = sum(record.graph_breaks.values())
    if breaks:
        sites = d.get("break_sites") or []
        where = f": {'; '.join(sites[:2])}" + (f" (+{len(sites) - 2} more)" if len(sites) > 2 else "") if sites else ""
        out.append(f"{breaks} graph break(s): the model runs as several graphs with eager code between them{where}")
    return out


# What Dynamo cannot trace, by the start of its reason, and what that means for the user's model.
KNOWN_UNTRACEABLE: dict[str, str] = {
    "Attempted to wrap RNN, GRU, or LSTM": (
        "torch.compile does not trace torch.nn's RNN, GRU and LSTM modules, so a forward that calls one runs "
        "eagerly (torch._dynamo.config.allow_rnn = True, torch's experimental switch, unrolls every time step "
        "into the graph)"
    ),
}


def _what_to_change(dynamo: dict[str, Any]) -> str:
    reasons = [*dynamo.get("unsupported", {}), *dynamo.get("frames_skipped", [])]
    if reasons:
        first = reasons[0]
        more = f" (+{len(reasons) - 1} more in report.md)" if len(reasons) > 1 else ""
        known = next((why for start, why in KNOWN_UNTRACEABLE.items() if start in first), None)
        return f"Dynamo could not trace: {first}{more}; " + (known or (
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

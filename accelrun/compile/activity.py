"""What the compiler is doing now, read by a progress line while a step compiles for long.

A forward written as a Python loop over 256 time steps took Dynamo 36 s to trace and the whole compile
84 s, with nothing on the screen but "the first step compiles". The compile's stages say here what they
are doing (``doing``); Dynamo's own start and end of each compile mark when one runs at all, which also
covers what accelrun does not drive (a recompile at a new shape, a graph break's next frame, Inductor).
One per process: Dynamo's callbacks are process-wide, and so is the console a progress line goes to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Compiling:
    """A compile under way: since when, and the stage it is in now (and since when)."""

    began: float  # time.perf_counter() when the outermost compile started
    since: float  # when the compiling began that this compile goes on (began, or an earlier one's start)
    traces: str  # what the outermost compile said it traces (the stage between the backend's graphs)
    stage: str  # "Dynamo traces the Python code", "g1.backward: lowering (412 ops)", ...
    stage_began: float


DYNAMO_TRACES = "Dynamo traces the Python code"
# A compile that starts this soon after the last one ended goes on with it (a graph break's next frame, a
# fallback after a refused precompile, the kernels' build at the first call): one count, one "done".
GAP_S = 2.0


class CompileActivity:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._now: Compiling | None = None
        self.ended_at = float("-inf")  # time.perf_counter() when the last outermost compile ended
        self._since = float("-inf")  # ``Compiling.since`` of the last one

    @contextmanager
    def compiling(self, stage: str = DYNAMO_TRACES) -> Iterator[None]:
        """A compile runs inside this block; nested blocks (Dynamo's own callbacks inside the graph
        cache's precompile) count as the outer one."""
        self.begin(stage)
        try:
            yield
        finally:
            self.end()

    def begin(self, stage: str = DYNAMO_TRACES) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                now = time.perf_counter()
                if now - self.ended_at >= GAP_S:
                    self._since = now
                self._now = Compiling(now, self._since, stage, stage, now)

    def end(self) -> None:
        with self._lock:
            self._depth = max(self._depth - 1, 0)
            if self._depth == 0:
                self._now = None
                self.ended_at = time.perf_counter()

    def close_chain(self) -> None:
        """The compiling so far is over, said so: a compile that starts next counts from its own start,
        however soon (a recompile in the step after the one whose line said "done")."""
        with self._lock:
            if self._now is None:
                self.ended_at = float("-inf")

    def doing(self, stage: str) -> None:
        """The stage a running compile is in now; nothing when none runs (a stage of a graph lowered
        outside any compile, as a test calling the backend directly, shows nowhere)."""
        with self._lock:
            if (was := self._now) is not None:
                self._now = Compiling(was.began, was.since, was.traces, stage, time.perf_counter())

    def tracing_again(self) -> None:
        """Back to the tracing the outermost compile began with (after a graph's backend stages)."""
        with self._lock:
            if (was := self._now) is not None:
                self._now = Compiling(was.began, was.since, was.traces, was.traces, time.perf_counter())

    def now(self) -> Compiling | None:
        with self._lock:
            return self._now

    def listen_to_dynamo(self) -> None:
        """Mark every compile Dynamo runs from now on (idempotent). Called again after
        ``torch._dynamo.reset()``, which drops every callback."""
        from accelrun.torch_private import dynamo_compile_callbacks as callbacks

        with self._lock:
            if self._on_start not in callbacks.start_callbacks:
                callbacks.register_start_callback(self._on_start)
            if self._on_end not in callbacks.end_callbacks:
                callbacks.register_end_callback(self._on_end)

    def _on_start(self, _args: object) -> None:
        self.begin()

    def _on_end(self, _args: object) -> None:
        self.end()


ACTIVITY = CompileActivity()

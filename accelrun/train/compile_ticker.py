"""A line now and then while a compile runs long: how long so far, and what the compiler is doing.

Without it a first step that compiled for 84 s (a forward looping over 256 time steps) showed nothing
after "the first step compiles", and a user could not tell a slow compile from a hung one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from accelrun.compile.activity import ACTIVITY, GAP_S, CompileActivity

FIRST_AFTER_S = 10.0  # a compile shorter than this (the default recipe's 2 s) prints nothing
EVERY_S = 15.0
POLL_S = 1.0


class CompileTicker:
    """Within ``with CompileTicker(say):``, ``say`` gets a line once compiling has gone on ``first_after``
    seconds, then every ``every`` seconds while it goes on, and one when it has ended. ``unstaged``: what
    to call a compile whose stages nobody says (another backend than accelrun's: Inductor's kernels)."""

    def __init__(self, say: Callable[[str], None], activity: CompileActivity = ACTIVITY,
                 first_after: float | None = None, every: float | None = None, poll: float | None = None,
                 unstaged: str | None = None) -> None:  # fmt: skip
        self.say, self.activity, self.unstaged = say, activity, unstaged
        self.first_after = FIRST_AFTER_S if first_after is None else first_after
        self.every = EVERY_S if every is None else every
        self.poll = POLL_S if poll is None else poll
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's checks and the training loop's settle()
        self._thread: threading.Thread | None = None
        self._since: float | None = None  # when the compiling now (or last) began; None: nothing pending
        self._told_at: float | None = None  # when a line was last said about it

    def __enter__(self) -> CompileTicker:
        self.activity.listen_to_dynamo()
        self._thread = threading.Thread(target=self._watch, name="accelrun-compile-ticker", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # A compile that ended since the last look is said to have ended; never in place of the run's
        # own error (a console gone under it).
        with contextlib.suppress(Exception):
            self.check(time.perf_counter(), final=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.check(time.perf_counter())
            except Exception:  # noqa: BLE001 (a console closed under it): a progress line is never worth a run
                return

    def settle(self) -> None:
        """Before the training loop prints a step's line: a compile said to be running that has ended is
        said to be done now, not a moment after the step's line."""
        if self.activity.now() is None:
            self.check(time.perf_counter(), final=True)
            self.activity.close_chain()

    def check(self, now: float, final: bool = False) -> None:
        """Say what is due at ``now`` (the thread calls this; tests call it with their own clock)."""
        with self._lock:
            self._check(now, final)

    def _check(self, now: float, final: bool) -> None:
        current, ended = self.activity.now(), self.activity.ended_at
        if self._since is not None and (current is None or current.since != self._since):
            if current is None and not final and now - ended < GAP_S:
                return  # another compile may go on with it
            self._done(ended)
        if current is None:
            return
        self._since = current.since
        if now - self._since < self.first_after or (self._told_at is not None and now - self._told_at < self.every):
            return
        if self.unstaged and current.stage == current.traces:  # nothing says its stages: no time in one
            self.say(f"still compiling, {_seconds(now - self._since)} so far: {self.unstaged}")
        else:
            self.say(f"still compiling, {_seconds(now - self._since)} so far: {current.stage} "
                     f"({_seconds(now - current.stage_began)} in it)")  # fmt: skip
        self._told_at = now

    def _done(self, ended: float) -> None:
        if self._told_at is not None and self._since is not None:
            self.say(f"compile done after {_seconds(ended - self._since)}")
        self._since = self._told_at = None


def _seconds(s: float) -> str:
    s = max(s, 0.0)
    return f"{s:.0f} s" if s < 120 else f"{int(s // 60)} min {int(s % 60):02d} s"

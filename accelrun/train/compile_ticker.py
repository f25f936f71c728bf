"""A line now and then while a compile runs long: how long so far, and what the compiler is doing.

Without it a first step that compiled for 84 s (a forward looping over 256 time steps) showed nothing
after "the first step compiles", and a user could not tell a slow compile from a hung one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from accelrun.compile.activity import ACTIVITY, CompileActivity, Compiling

FIRST_AFTER_S = 10.0  # a compile shorter than this (the default recipe's 2 s) prints nothing
EVERY_S = 15.0
POLL_S = 1.0


class CompileTicker:
    """Within ``with CompileTicker(say):``, ``say`` gets a line once a compile has run ``first_after``
    seconds, then every ``every`` seconds while it goes on, and one when it ends."""

    def __init__(self, say: Callable[[str], None], activity: CompileActivity = ACTIVITY,
                 first_after: float | None = None, every: float | None = None, poll: float | None = None) -> None:  # fmt: skip
        self.say, self.activity = say, activity
        self.first_after = FIRST_AFTER_S if first_after is None else first_after
        self.every = EVERY_S if every is None else every
        self.poll = POLL_S if poll is None else poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._told: Compiling | None = None  # the compile the last line was about
        self._told_at = 0.0

    def __enter__(self) -> CompileTicker:
        self.activity.listen_to_dynamo()
        self._thread = threading.Thread(target=self._watch, name="accelrun-compile-ticker", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.check(time.perf_counter())  # a compile that ended since the last look is said to have ended

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.check(time.perf_counter())
            except Exception:  # noqa: BLE001 (a console closed under it): a progress line is never worth a run
                return

    def check(self, now: float) -> None:
        """Say what is due at ``now`` (the thread calls this; tests call it with their own clock)."""
        current = self.activity.now()
        told = self._told
        if told is not None and (current is None or current.began != told.began):
            self.say(f"compile done after {_seconds(now - told.began)}")
            self._told = told = None
        if current is None or now - current.began < self.first_after:
            return
        if told is not None and now - self._told_at < self.every:
            return
        graphs = f"; {current.graphs} graph{'s' * (current.graphs != 1)} so far" if current.graphs else ""
        self.say(f"still compiling, {_seconds(now - current.began)} so far: {current.stage} "
                 f"({_seconds(now - current.stage_began)} in it{graphs})")  # fmt: skip
        self._told, self._told_at = current, now


def _seconds(s: float) -> str:
    s = max(s, 0.0)
    return f"{s:.0f} s" if s < 120 else f"{int(s // 60)} min {int(s % 60):02d} s"

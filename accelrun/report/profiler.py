"""``report.profile_steps: [a, b]``: a torch profiler trace of steps a..b (inclusive, 1-based, as in
``metrics.jsonl``), written in Chrome trace format to ``<run dir>/profile/trace.json``.

Open the file in Perfetto (ui.perfetto.dev) or chrome://tracing. Each profiled step is one
``accelrun step N`` range on the timeline. Profiling slows the steps it covers, so their lines in
``metrics.jsonl`` carry ``"profiled": true`` and the report leaves them out of steady-state figures.

The training loop uses it as::

    with profile_steps(cfg.report.profile_steps, run_dir, start_step, rank) as prof:
        for step in ...:
            ...                                  # one training step, timed
            prof.step(step, record)              # after the step, before its metrics line is written

The profiler starts after step a-1 (or on entry, when the run starts inside the range) and stops
after step b, so starting and exporting it never lands inside a timed step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import TracebackType
from typing import Any

PROFILE_DIR = "profile"


def trace_path(run_dir: str | Path, rank: int = 0) -> Path:
    """Where rank ``rank``'s trace goes: ``profile/trace.json`` (rank 0), ``profile/trace-rank<N>.json``."""
    name = "trace.json" if rank == 0 else f"trace-rank{rank}.json"
    return Path(run_dir) / PROFILE_DIR / name


class StepProfiler:
    """Records a torch profiler trace over a range of training steps; a no-op without a range."""

    def __init__(self, steps: tuple[int, int] | list[int] | None, run_dir: str | Path, start_step: int = 0,
                 rank: int = 0) -> None:
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
        self.path = trace_path(run_dir, rank)
        self.start_step = start_step
        self.profiled: list[int] = []  # steps the trace covers
        self._prof: Any = None
        self._range: contextlib.AbstractContextManager | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def __enter__(self) -> StepProfiler:
        self._maybe_start(self.start_step + 1)
        return self

    def step(self, step: int, record: dict | None = None) -> None:
        """Step ``step`` has finished: mark its metrics line if it was profiled; start or stop the trace."""
        if self.active:
            self.profiled.append(step)
            if record is not None:
                record["profiled"] = True
            self._end_range()
            if step >= self.last:
                self._stop()
                return
            self._begin_range(step + 1)
            return
        self._maybe_start(step + 1)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # A run that stops inside the range (preempted, diverged, fewer steps) keeps what was recorded.
        if self.active:
            self._end_range()
            self._stop()

    def _maybe_start(self, next_step: int) -> None:
        if not self.first <= next_step <= self.last:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.start()
        self._begin_range(next_step)

    def _begin_range(self, step: int) -> None:
        from torch.profiler import record_function

        self._range = record_function(f"accelrun step {step}")
        self._range.__enter__()

    def _end_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(self.path)  # a reader never sees half a trace


def profile_steps(steps: tuple[int, int] | list[int] | None, run_dir: str | Path, start_step: int = 0,
                  rank: int = 0) -> StepProfiler:
    """A :class:`StepProfiler` for ``report.profile_steps`` (None: records nothing)."""
    return StepProfiler(steps, run_dir, start_step, rank)

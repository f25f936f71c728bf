"""Where a training step's time goes, measured without stopping the device at every phase.

On a CPU the work of a phase is done when its call returns, so host time at each boundary is the
phase's time. On CUDA a call returns as soon as its kernels are queued; synchronising at every phase
boundary to read the host clock would keep the host from queueing the next phase while the GPU runs
this one. So on CUDA each boundary records an event on the current stream, and the events are read
after the one synchronisation at the end of the step (``finish``), or at the end of a later step
whose synchronisation covers this one's events too (``finish(synchronize=False)``).

    clock = StepClock(device)
    a = clock.mark(); forward(); b = clock.mark()
    clock.finish()
    clock.seconds(a, b)
"""

from __future__ import annotations

import time

import torch


class StepClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list = []
        self._done = not self.cuda

    def mark(self) -> int:
        """A phase boundary, now (CPU) or when the stream reaches it (CUDA); returns its index."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def finish(self, synchronize: bool = True) -> None:
        """The step's one synchronisation (CUDA): every mark can be read after it.

        ``synchronize=False``: the device was already synchronised after this clock's last mark (by
        the finish of a later step's clock, when the loop reads several steps at once), so the marks
        can be read without waiting again."""
        if self.cuda and synchronize:
            torch.cuda.synchronize()
        self._done = True

    def seconds(self, a: int, b: int) -> float:
        if not self._done:
            raise RuntimeError("StepClock.seconds before finish(): the CUDA events may not have happened yet")
        if self.cuda:
            return self._marks[a].elapsed_time(self._marks[b]) / 1e3  # milliseconds
        return self._marks[b] - self._marks[a]

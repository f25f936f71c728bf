"""StepClock: host time on a CPU; on CUDA, events read after one synchronisation per step (pretended
here: a fake Event and synchronize record what the clock does)."""

from __future__ import annotations

import pytest
import torch

from accelrun.train.step_clock import StepClock


def test_cpu_phases_are_host_time():
    clock = StepClock(torch.device("cpu"))
    a = clock.mark()
    torch.ones(256, 256) @ torch.ones(256, 256)
    b = clock.mark()
    clock.finish()
    assert clock.seconds(a, b) > 0 and clock.seconds(a, a) == 0


def test_cuda_phases_are_events_read_after_one_synchronisation(monkeypatch):
    log = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self, stream=None):
            log.append("record")
            self.at = len(log)

        def elapsed_time(self, end):
            assert log[-1] == "synchronize", "read before the step's synchronisation"
            return 1000.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("synchronize"))
    clock = StepClock(torch.device("cuda", 0))
    marks = [clock.mark() for _ in range(4)]
    with pytest.raises(RuntimeError, match="before finish"):
        clock.seconds(marks[0], marks[1])
    clock.finish()
    assert log.count("synchronize") == 1 and log.index("synchronize") == 4  # after every mark, once
    assert clock.seconds(marks[0], marks[3]) == pytest.approx(3.0)

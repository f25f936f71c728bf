"""Pieces of the training package on their own: LR schedule, resume choice, run locks."""

from __future__ import annotations

import pytest

from accelrun.config.schema import LRScheduleConfig
from accelrun.report.rundir import create_run_dir, hold_run_lock, is_running
from accelrun.train.optim import lr_factor


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_schedule_warms_up_then_decays_to_the_floor_on_the_last_step(name):
    cfg = LRScheduleConfig(name=name, warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg, 20) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[4:-1], factors[5:], strict=True))


def test_constant_schedule():
    cfg = LRScheduleConfig(name="constant", warmup_steps=0)
    assert {lr_factor(s, cfg, 10) for s in range(10)} == {1.0}


def test_run_lock_marks_a_live_run(tmp_path):
    run = create_run_dir(tmp_path, "x")
    assert not is_running(run)
    with hold_run_lock(run):
        assert is_running(run)
    assert not is_running(run)

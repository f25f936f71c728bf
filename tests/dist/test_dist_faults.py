"""Faults in a multi-process job: a rank killed mid-run, and a rank that hangs.

These start ``accelrun train`` as a process of its own: the test signals the agent's workers from
outside, and the CLI's ``--max-restarts`` is part of what is tested.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from accelrun.report.metrics import read_metrics
from tests.dist.jobs import (
    FSDP2,
    LOSS_RTOL,
    gone,
    kill_all,
    ranks_of,
    start_cli,
    stop,
    tiny_overrides,
)

STEPS = 20


def wait_for_steps(job, metrics_glob, runs, n: int, timeout: float):
    """The metrics file once it has ``n`` lines (None if the job ended or the time ran out first)."""
    deadline = time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        found = list(runs.glob(metrics_glob))
        if found and len(read_metrics(found[0])) >= n:
            return found[0]
        time.sleep(0.02)
    return None


def test_killed_rank_restarts_the_group_which_resumes_and_matches(reference, tmp_path):
    """One job checks two things: it starts from a one-process checkpoint (1 process -> 2 FSDP
    ranks), and after a rank is killed the agent restarts the group, which resumes from the job's
    own newest checkpoint; every step's loss matches the one-process run's."""
    ref = reference(STEPS)
    runs = tmp_path / "runs"
    job = start_cli(*tiny_overrides(runs, STEPS, "name=killed", "checkpoint.every=2",
                                    f"checkpoint.resume={ref.checkpoint(2)}"), *FSDP2, "--max-restarts", "1")
    try:
        # Steps 3, 4, 5 done: the job's own step-4 checkpoint is complete (it is saved before step 5).
        metrics = wait_for_steps(job, "killed/*/metrics.jsonl", runs, 3, timeout=240)
        assert metrics is not None, "the job did not get going"
        workers = ranks_of(job.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out, _ = job.communicate(timeout=300)
    finally:
        stop(job)
    assert job.returncode == 0, out[-3000:]
    assert "step-000002 at step 2" in out, out[-3000:]  # the first start resumed the one-process checkpoint
    assert "restart 1 of the group" in out, out[-3000:]  # the restarted group resumed its own checkpoint

    got = read_metrics(metrics)
    assert [m["step"] for m in got] == list(range(3, STEPS + 1))  # redone steps are not counted twice
    assert [m["loss"] for m in got] == pytest.approx(ref.losses[2:], rel=LOSS_RTOL)


def test_a_stuck_rank_makes_the_others_time_out_naming_rank_and_phase(tmp_path):
    runs = tmp_path / "runs"
    job = start_cli(*tiny_overrides(runs, 100000, "name=stuck", "parallel.timeout_s=5", "checkpoint.every=100000"),
                    *FSDP2)
    workers: list[int] = []
    try:
        assert wait_for_steps(job, "stuck/*/metrics.jsonl", runs, 2, timeout=120) is not None, "no steps"
        workers = ranks_of(job.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGSTOP)  # rank 1 stops answering, as a hung process would
        # Rank 0 times out after parallel.timeout_s and exits; the agent would then wait its grace
        # period (30 s) for the stopped rank to take SIGTERM. Kill it as soon as rank 0 is gone.
        deadline = time.time() + 60
        while not gone(workers[0]) and time.time() < deadline:
            time.sleep(0.05)
        kill_all(workers[1:])
        out, _ = job.communicate(timeout=120)
    finally:
        kill_all(workers)
        stop(job)
    assert job.returncode != 0
    assert "rank 0: a collective in" in out and "parallel.timeout_s = 5 s" in out, out[-3000:]

"""Faults in a multi-process job: a rank killed mid-run, then a rank that hangs.

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

STEPS = 40  # the job must still be running when each fault is injected; steps cost little


def wait_for_step(job, metrics_glob, runs, step: int, timeout: float):
    """The metrics file once it has a line for ``step`` or later (None if the job ended or the time
    ran out first)."""
    deadline = time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        found = list(runs.glob(metrics_glob))
        if found and (rows := read_metrics(found[0])) and rows[-1]["step"] >= step:
            return found[0]
        time.sleep(0.02)
    return None


def test_killed_rank_restarts_the_group_which_resumes_and_a_stuck_rank_times_out(reference, tmp_path):
    """One job, three faults' worth of checks (each job start costs more than all its steps):

    1. it starts from a one-process checkpoint (1 process -> 2 FSDP ranks);
    2. a rank is killed: the agent restarts the group, which resumes from the job's own newest
       checkpoint, and every step's loss matches the one-process run's;
    3. a rank of the restarted group stops answering: the other times out, naming its rank, the
       phase it waited in and parallel.timeout_s, and the job fails (no restarts left).
    """
    ref = reference(STEPS)
    runs = tmp_path / "runs"
    job = start_cli(*tiny_overrides(runs, STEPS, "name=faults", "checkpoint.every=2", "parallel.timeout_s=15",
                                    f"checkpoint.resume={ref.checkpoint(2)}"), *FSDP2, "--max-restarts", "1")
    workers: list[int] = []
    try:
        # Steps 3, 4, 5 done: the job's own step-4 checkpoint is complete (it is saved before step 5).
        metrics = wait_for_step(job, "faults/*/metrics.jsonl", runs, 5, timeout=240)
        assert metrics is not None, "the job did not get going"
        workers = ranks_of(job.pid)
        assert len(workers) == 2, workers
        killed = workers[1]
        os.kill(killed, signal.SIGKILL)

        deadline = time.time() + 120
        while time.time() < deadline:  # the agent stops the old group, then forks a new one
            restarted = ranks_of(job.pid)
            if len(restarted) == 2 and not set(restarted) & set(workers):
                break
            time.sleep(0.02)
        assert len(restarted) == 2 and not set(restarted) & set(workers), (workers, restarted)
        workers = restarted
        # The restarted group (the old one is gone) trains two steps past the last one the old one did.
        done_before = read_metrics(metrics)[-1]["step"]
        assert wait_for_step(job, "faults/*/metrics.jsonl", runs, done_before + 2, timeout=120), "no restart"
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
    said = " ".join(out.split())  # the terminal wraps lines where the run's path length puts the break
    assert "step-000002 at step 2" in said, out[-3000:]  # the first start resumed the one-process checkpoint
    assert "restart 1 of the group" in said, out[-3000:]  # the restarted group resumed its own checkpoint
    # the launcher said which rank died, and how, as the agent restarted the group (it said nothing)
    assert f"rank 1 on node {os.uname().nodename} (pid {killed}) was killed by SIGKILL" in said, out[-3000:]
    assert "restarting the ranks (restart 1 of the 1 --max-restarts allows)" in said, out[-3000:]
    assert job.returncode != 0
    assert "rank 0: a collective in" in said and "parallel.timeout_s = 15 s" in said, out[-3000:]

    got = read_metrics(metrics)
    steps = [m["step"] for m in got]
    # Redone steps are not counted twice, and the restarted group went two steps past the old one's last.
    assert steps == list(range(3, 3 + len(steps))) and steps[-1] >= done_before + 2
    assert [m["loss"] for m in got] == pytest.approx(ref.losses[2:2 + len(steps)], rel=LOSS_RTOL)

"""Faults in a multi-process job: a rank killed mid-run, and the group restarted by the agent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from accelrun.report.metrics import read_metrics
from tests.conftest import DEFAULT_CONFIG, REPO, TINY

STEPS = 20


def start(runs: Path, name: str, *extra: str) -> subprocess.Popen:
    args = [*TINY, f"train.steps={STEPS}", f"report.runs_dir={runs}", f"name={name}", "checkpoint.every=4",
            "parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.micro_batch=2"]
    env = {**os.environ, "ACCELRUN_NO_PEAK_PROBE": "1"}
    return subprocess.Popen([sys.executable, "-m", "accelrun.cli.main", "train", str(DEFAULT_CONFIG), *args, *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killed_rank_restarts_the_group_which_resumes_and_matches(tmp_path):
    runs = tmp_path / "runs"
    ref = start(runs, "ref")
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out[-3000:]

    job = start(runs, "killed", "--max-restarts", "1")
    deadline = time.time() + 240
    metrics = None
    while time.time() < deadline and job.poll() is None:
        found = list((runs / "killed").glob("*/metrics.jsonl"))
        if found and len(read_metrics(found[0])) >= 8:
            metrics = found[0]
            break
        time.sleep(0.05)
    assert metrics is not None, "the job did not get going"
    workers = children(job.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out[-3000:]
    assert "restart 1 of the group" in out

    (ref_dir,) = list((runs / "ref").iterdir())
    got, want = read_metrics(metrics), read_metrics(ref_dir / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))  # redone steps are not counted twice
    assert [m["loss"] for m in got] == [m["loss"] for m in want]


def test_a_stuck_rank_makes_the_others_time_out_naming_rank_and_phase(tmp_path):
    runs = tmp_path / "runs"
    job = start(runs, "stuck", "train.steps=100000", "parallel.timeout_s=5", "checkpoint.every=100000")
    deadline = time.time() + 120
    while time.time() < deadline and job.poll() is None:
        found = list((runs / "stuck").glob("*/metrics.jsonl"))
        if found and len(read_metrics(found[0])) >= 2:
            break
        time.sleep(0.05)
    workers = children(job.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGSTOP)  # rank 1 stops answering, as a hung process would
    try:
        out, _ = job.communicate(timeout=120)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert job.returncode != 0
    assert "rank 0: a collective in" in out and "parallel.timeout_s = 5 s" in out, out[-3000:]

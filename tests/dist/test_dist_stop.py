"""Stopping a 2-rank job on a signal: SIGTERM to the process group (SLURM, scancel), SIGTERM to the
launcher alone (``kill PID``), SIGINT to the group (Ctrl-C). Each must end with every rank past the
same step, one complete checkpoint of that step, exit 143 / 130 and one line; the checkpoint must
resume into exactly the losses of a run that was never stopped.

The job is ``accelrun train`` in a session of its own, so that "the process group" is the job's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.dist import stop
from accelrun.dist.slurm import sbatch_script
from accelrun.report.metrics import read_metrics
from accelrun.train.resume import decide_resume
from tests.conftest import DEFAULT_CONFIG, REPO
from tests.dist.jobs import (
    FSDP2,
    gone,
    kill_all,
    losses,
    stop_group,
    tiny_overrides,
    train_job,
    wait_for_ranks,
)

STEPS = 40
EXACT = 1e-6  # the same layout resumed: the same sums in the same order as the run that never stopped


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    """The losses of the same 2-rank job, never stopped."""
    runs = tmp_path_factory.mktemp("uninterrupted")
    return losses(train_job(runs, STEPS, "name=whole", "checkpoint.every=1000", *FSDP2).run_dir)


def start_job(runs, name: str) -> subprocess.Popen:
    env = {**os.environ, "ACCELRUN_NO_PEAK_PROBE": "1"}
    args = [*tiny_overrides(runs, STEPS, f"name={name}", "checkpoint.every=1000"), *FSDP2]
    return subprocess.Popen([sys.executable, "-m", "accelrun.cli.main", "train", str(DEFAULT_CONFIG), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_step(job, runs, name: str, step: int, timeout: float = 240):
    deadline = time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        found = list(runs.glob(f"{name}/*/metrics.jsonl"))
        if found and (rows := read_metrics(found[0])) and rows[-1]["step"] >= step:
            return found[0].parent
        time.sleep(0.02)
    return None


@contextlib.contextmanager
def job_past_step_2(runs, name: str):
    """A 2-rank job once it has run 2 steps: (its launcher's process, its ranks, its run folder); whatever
    is left of it is killed after."""
    job = start_job(runs, name)
    workers: list[int] = []
    try:
        workers = wait_for_ranks(job, 2)
        assert len(workers) == 2, workers
        run_dir = wait_for_step(job, runs, name, 2)
        assert run_dir is not None, "the job did not get going"
        yield job, workers, run_dir
    finally:
        kill_all(workers)
        stop_group(job)


@pytest.mark.parametrize("target, sig", [("group", signal.SIGTERM), ("launcher", signal.SIGTERM),
                                         ("group", signal.SIGINT)])
def test_signal_stops_every_rank_after_one_step_with_one_checkpoint_that_resumes(target, sig, uninterrupted,
                                                                                  tmp_path):
    runs = tmp_path / "runs"
    with job_past_step_2(runs, "stopped") as (job, _, run_dir):
        if target == "group":
            os.killpg(job.pid, sig)
        else:
            os.kill(job.pid, sig)
        out, _ = job.communicate(timeout=120)
    code = 128 + sig
    assert job.returncode == code, out[-3000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]

    (ckpt,) = (run_dir / "checkpoints").glob("step-*")  # one: checkpoint.every is far away
    step = json.loads((ckpt / "train_state.json").read_text())["step"]
    assert (ckpt / "COMPLETE").is_file() and not list((run_dir / "checkpoints").glob(".tmp-*"))
    status = "interrupted" if sig == signal.SIGINT else "preempted"
    line = f"{status} by {sig.name} after step {step}: all 2 ranks saved {ckpt}"
    assert line in " ".join(out.split()), out[-3000:]
    assert f"(exit {code})" in out
    assert 2 <= step < STEPS and not (run_dir / "report.json").exists()
    # Stopped at the step it saved, and every step before it as the uninterrupted run had it.
    assert losses(run_dir) == pytest.approx(uninterrupted[:step], rel=EXACT)

    # the same name: the stopped run's continuation (its report has the whole run's figures)
    resumed = train_job(runs, STEPS, "name=stopped", f"checkpoint.resume={ckpt}", *FSDP2)
    assert resumed.status == "finished"
    assert resumed.report["resumed_from"] == str(ckpt)
    assert losses(resumed.run_dir) == pytest.approx(uninterrupted[step:], rel=EXACT)
    # the whole run's tokens are the job's, both ranks' (they were one rank's: a trial's)
    whole, report = resumed.report["whole_run"], resumed.report
    assert whole["steps"] == STEPS and report["world_size"] == 2, whole
    assert whole["tokens"] == STEPS * report["tokens_per_step"] * 2, (whole, report["tokens_per_step"])


def test_ranks_whose_launcher_was_killed_stop_with_a_checkpoint_and_exit(uninterrupted, tmp_path):
    """A trial's kill -9 of `accelrun train`: its two ranks trained on to the end unsupervised, racing the
    rerun that resumed the same run, and then waited for ever for an agent to collect them (SIGTERM and
    SIGINT ignored). They now stop as on a SIGTERM: one checkpoint of the step they agree on, then exit."""
    runs = tmp_path / "runs"
    with job_past_step_2(runs, "orphaned") as (job, workers, run_dir):
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.time() + 120
        while time.time() < deadline and not all(gone(w) for w in workers):
            time.sleep(0.1)
        assert all(gone(w) for w in workers), "the ranks outlived their launcher"
    (ckpt,) = (run_dir / "checkpoints").glob("step-*")  # one: checkpoint.every is far away
    step = json.loads((ckpt / "train_state.json").read_text())["step"]
    assert (ckpt / "COMPLETE").is_file() and 2 <= step < STEPS
    assert losses(run_dir) == pytest.approx(uninterrupted[:step], rel=EXACT)


def test_a_rank_reads_its_launchers_end_as_a_stop(tmp_path, monkeypatch):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with stop.catch_signals(watch=tmp_path):
        monkeypatch.delenv(stop.LAUNCHER_ENV, raising=False)
        me = stop.set_launcher_identity()
        assert stop.requested() == 0 and not stop.launcher_gone() and stop.launcher_token() == me.split(":")[2]
        monkeypatch.setenv(stop.LAUNCHER_ENV, f"{dead.pid}:1:abc")
        assert stop.launcher_gone() and stop.requested() == signal.SIGTERM
        pid, started, token = me.split(":")  # this process's number, another start time: a number reused
        monkeypatch.setenv(stop.LAUNCHER_ENV, f"{pid}:{int(started) + 1}:{token}")
        assert stop.launcher_gone()


def test_stop_request_file_is_read_by_ranks_and_a_late_stop_warns(tmp_path):
    """The launcher-only path without processes: the launcher's signal becomes a request a rank reads."""
    with stop.catch_signals(forward_to=tmp_path):
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this thread before kill returns
        assert stop.requested() == signal.SIGTERM
        assert stop.late_warning({stop.STOP_LEAD_ENV: "0"}) is not None  # any stop takes longer than 0 s
        assert stop.late_warning({stop.STOP_LEAD_ENV: "3600"}) is None
    assert (tmp_path / stop.REQUEST_FILE).read_text() == str(int(signal.SIGTERM))
    with stop.catch_signals(watch=tmp_path):  # a rank: it got no signal, its launcher did
        assert stop.requested() == signal.SIGTERM
    with stop.catch_signals():  # a new run forgets the old signal
        assert stop.requested() == 0


def test_a_second_ctrl_c_stops_a_one_process_run_at_once(monkeypatch, capfd):
    """One process: the first SIGINT asks for a checkpoint after the step, and says so at once (a trial's
    Ctrl-C during a compile looked ignored until the step ended); a second one is the user not willing to
    wait for it, and stops the run where it is (KeyboardInterrupt: exit 130, nothing saved). A second
    SIGTERM changes nothing (SLURM signals again), nor does a rank's second SIGINT (its launcher decides
    and kills it)."""
    with stop.catch_signals():
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() == signal.SIGINT and not stop.stopped_at_once()  # the first: a checkpoint follows
        assert "Ctrl-C: stopping after the step in progress (Ctrl-C again stops at once" in capfd.readouterr().err
        # the same SIGINT delivered twice at once (GNU timeout signals its child, then its process group):
        # one signal, not a second Ctrl-C (a 2-rank run had killed its ranks without saving)
        monkeypatch.setattr(stop, "SAME_SIGNAL_WITHIN_S", 60.0)  # (however slow this machine is now)
        os.kill(os.getpid(), signal.SIGINT)
        assert not stop.stopped_at_once()
        monkeypatch.setattr(stop, "SAME_SIGNAL_WITHIN_S", 0.0)  # a person's second press comes later
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop.stopped_at_once()  # what the command's last line says
    with stop.catch_signals():
        assert not stop.stopped_at_once()  # a new run forgets it
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() == signal.SIGTERM
    with tempfile.TemporaryDirectory() as folder, stop.catch_signals(watch=Path(folder)):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() == signal.SIGINT
    assert "Ctrl-C" not in capfd.readouterr().err  # SIGTERM and a rank's copy: the launcher's line says it


def test_sbatch_script_asks_for_sigterm_before_the_limit_and_requeues():
    text = sbatch_script("configs/llama.yaml", [], name="x", nnodes=2, nproc_per_node=8, gpus=True,
                         partition=None, time_limit="04:00:00", account=None, stop_lead_s=300)
    assert "#SBATCH --signal=TERM@300" in text and "#SBATCH --requeue" in text
    assert f"export {stop.STOP_LEAD_ENV}=300" in text
    assert 'if [ "$code" -eq 143 ]; then scontrol requeue "$SLURM_JOB_ID"' in text
    bash = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr
    r = CliRunner().invoke(cli, ["slurm", str(DEFAULT_CONFIG), "parallel.nproc_per_node=2", "train.micro_batch=8",
                                 "--stop-lead", "90"])
    assert r.exit_code == 0 and "#SBATCH --signal=TERM@90 " in r.output, r.output


def test_slurm_checks_the_lead_against_the_time_limit_and_the_planned_steps_to_a_stop():
    """A trial: `--time 00:01:00` under the default 120 s lead gave no word, nor did a 70B recipe whose
    stop waits 10 planned steps of 11 s for its host read before writing a checkpoint."""
    from accelrun.cli.slurm_cmd import slurm_seconds

    assert [slurm_seconds(t) for t in ("30", "30:15", "04:00:00", "1-00", "1-02:30", "1-02:30:05", "x")] == \
        [1800, 1815, 14400, 86400, 95400, 95405, None]
    r = CliRunner().invoke(cli, ["slurm", str(DEFAULT_CONFIG), "--time", "00:01:00"])
    assert r.exit_code == 2 and "is 60 s, no more than --stop-lead 120 s" in r.output, r.output
    for unlimited in ("0", "UNLIMITED", "infinite"):  # SLURM's no limit (a review's finding)
        assert CliRunner().invoke(cli, ["slurm", str(DEFAULT_CONFIG), "--time", unlimited]).exit_code == 0
    big = REPO / "configs" / "llama3-70b-h100.yaml"
    r = CliRunner().invoke(cli, ["slurm", str(big)])
    assert r.exit_code == 0 and "warning: a stop waits for the next host read, up to report.read_every = 10" in \
        " ".join(r.stderr.split()), r.stderr
    assert r.stdout.startswith("#!/bin/bash")  # the script alone on stdout
    cpu = CliRunner().invoke(cli, ["slurm", str(DEFAULT_CONFIG), "parallel.nnodes=4", "train.device=cpu"])
    assert cpu.exit_code == 0 and "--gpus-per-node" not in cpu.stdout, cpu.stdout  # a trial's CPU job asked for GPUs
    assert "--gpus-per-node" in CliRunner().invoke(cli, ["slurm", str(big)]).stdout
    quiet = CliRunner().invoke(cli, ["slurm", str(big), "report.read_every=2"])
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr, quiet.stderr


def test_a_requeued_multi_node_job_resumes_its_own_folder(tmp_path):
    """A requeued SLURM job keeps its id, so its nodes enter the same job-<id> folder again: its own
    newest checkpoint (same training hash) is where it goes on, not a fresh start over it."""
    runs_root = tmp_path / "runs" / "llama-debug"
    job = runs_root / "job-slurm42"
    for step, training_hash in ((4, "h"), (6, "h"), (8, "other")):
        ckpt = job / "checkpoints" / f"step-{step:06d}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save({"w": torch.zeros(4)}, checkpoint_id=ckpt)  # whole: damaged ones are passed over
        (ckpt / "train_state.json").write_text(json.dumps({"step": step, "training_hash": training_hash}))
        (ckpt / "COMPLETE").write_text("")
    decision = decide_resume("auto", runs_root, job, "h")
    assert decision.checkpoint is not None and decision.checkpoint.step == 6, decision
    assert decide_resume("none", runs_root, job, "h").checkpoint is None


def test_a_second_ctrl_c_kills_a_job_whose_rank_is_stuck(tmp_path):
    """The first Ctrl-C asks for a checkpoint, but a stuck rank never reaches the step boundary; the
    second kills the ranks (SIGKILL, which a stuck rank cannot ignore) and exits 130 with one line."""
    runs = tmp_path / "runs"
    job = start_job(runs, "stuck")
    workers: list[int] = []
    try:
        workers = wait_for_ranks(job, 2)
        assert len(workers) == 2, workers
        assert wait_for_step(job, runs, "stuck", 1) is not None, "the job did not get going"
        os.kill(workers[1], signal.SIGSTOP)
        os.killpg(job.pid, signal.SIGINT)
        # The launcher has taken the first one when its stop request is in the job's folder (the one
        # rank 0 recorded itself in): only then is the next SIGINT a second one.
        folder = None
        deadline = time.time() + 60
        while folder is None and time.time() < deadline:
            for proc in Path(tempfile.gettempdir()).glob("accelrun-rank-errors-*/proc-0.json"):
                with contextlib.suppress(OSError, ValueError):
                    if json.loads(proc.read_text())["pid"] == workers[0] and (proc.parent / stop.REQUEST_FILE).exists():
                        folder = proc.parent
            time.sleep(0.02)
        assert folder is not None, "the launcher never took the first Ctrl-C"
        time.sleep(4 * stop.SAME_SIGNAL_WITHIN_S)  # a person's second press (sooner, it is the first one again)
        os.killpg(job.pid, signal.SIGINT)
        out, _ = job.communicate(timeout=120)
    finally:
        kill_all(workers)
        stop_group(job)
    assert job.returncode == 130, out[-3000:]
    assert "aborted by a second SIGINT: the ranks were killed without saving" in " ".join(out.split()), out[-3000:]
    assert "Traceback" not in out and all(gone(pid) for pid in workers)

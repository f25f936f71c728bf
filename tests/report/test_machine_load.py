"""Every run says when other processes took a noticeable share of the CPU while its loop ran, and how
much (issue 30: the README's first command took 3.43 s a step beside another job, and said nothing)."""

from __future__ import annotations

import itertools

from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.report import machine_load
from accelrun.report.machine_load import busy_note, others_share
from tests.conftest import DEFAULT_CONFIG, TINY


def test_others_share_subtracts_the_jobs_own_cpu_time():
    # 10 s on 2 cores: 20 core-seconds; the machine was busy 18 of them, the job's ranks used 8.
    assert others_share(18.0, 8.0, 10.0, 2) == 0.5
    assert others_share(7.0, 8.0, 10.0, 2) == 0.0  # rounding between the two clocks: never negative
    assert others_share(None, 8.0, 10.0, 2) is None
    assert busy_note(0.05, "the training loop") is None
    assert "used 51% of this machine's CPU during the training loop" in busy_note(0.51, "the training loop")
    # what to do about it, concretely: when to measure, and the key that gives the neighbour its core back
    assert "run again when it is quiet" in busy_note(0.71, "the training loop")
    assert "(train.threads=1)" in busy_note(0.71, "the training loop")
    assert "train.threads" not in busy_note(0.71, "the training loop", threads=1)  # already so: no advice


def test_a_run_beside_a_busy_neighbour_says_so_in_the_terminal_and_the_report(tmp_path, monkeypatch):
    # /proc/stat as a machine where something else keeps every core busy: 1000 core-seconds a reading.
    readings = itertools.count(start=0.0, step=1000.0)
    monkeypatch.setattr(machine_load, "_busy_cpu_s", lambda: next(readings))
    args = ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=2", f"report.runs_dir={tmp_path / 'runs'}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "warning: other processes used 100% of this machine's CPU during the training loop" in out
    run_dir = next((tmp_path / "runs").glob("*/*"))
    md = (run_dir / "report.md").read_text()
    assert "other processes used 100% of this machine's CPU" in md


def test_a_quiet_run_says_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(machine_load, "_busy_cpu_s", lambda: 0.0)  # nobody, not even the job, used the CPU
    args = ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=2", f"report.runs_dir={tmp_path / 'runs'}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "other processes used" not in result.output

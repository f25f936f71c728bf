"""A single CPU run takes the cores nobody else is using (issue 30: beside one busy process on 2 cores,
2 threads ran 1,348 ms a step and 1 thread 765 ms)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.report import machine_load
from accelrun.train import threads
from tests.conftest import DEFAULT_CONFIG, TINY


@pytest.mark.parametrize(("usable", "others", "expected"), [
    (2, None, 2), (2, 0.0, 2), (2, 0.3, 2),  # a core 30% used still runs our thread most of the time
    (2, 0.95, 1), (2, 1.9, 1), (4, 1.0, 3), (4, 2.7, 1), (1, 1.0, 1),
])
def test_threads_are_the_cores_left(usable, others, expected):
    assert threads.threads_for(usable, others) == expected


class _ExactLook(machine_load.CpuWindow):  # a busy test machine may oversleep the look
    def wall_s(self) -> float:
        return threads.LOOK_S


@pytest.mark.parametrize(("busy_per_look", "expected"), [((0.3, 0.3), 1), ((0.3, 0.0), 2), ((0.0,), 2)])
def test_a_neighbour_must_be_there_in_both_looks_to_take_a_core(monkeypatch, busy_per_look, expected):
    """A burst (another process starting) in the first look alone leaves every core to the run."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "CpuWindow", _ExactLook)
    monkeypatch.setattr(machine_load, "_tree_cpu_s", lambda: 0.0)
    monkeypatch.setattr(machine_load.os, "cpu_count", lambda: 2)
    readings = iter(itertools.accumulate([0.0, *(x for b in busy_per_look for x in (b, 0.0))]))
    monkeypatch.setattr(machine_load, "_busy_cpu_s", lambda: next(readings))
    choice = threads.choose_threads(look_s=0.0)
    assert choice.threads == expected, choice


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert machine_load._cgroup_quota_cores(tmp_path / "cpu.max") == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert machine_load._cgroup_quota_cores(tmp_path / "cpu.max") is None
    assert machine_load._cgroup_quota_cores(tmp_path / "missing") is None


def test_a_run_beside_a_busy_process_takes_fewer_threads_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELRUN_FIXED_THREADS")
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    # /proc/stat as a machine where a neighbour keeps one core busy: during the look (0.3 s) and after.
    readings = itertools.count(start=0.0, step=0.3)
    monkeypatch.setattr(machine_load, "_busy_cpu_s", lambda: next(readings))
    monkeypatch.setattr(threads, "LOOK_S", 0.3)

    class LookOfExactlyLookS(machine_load.CpuWindow):  # a busy test machine may oversleep the look
        def wall_s(self) -> float:
            return threads.LOOK_S

    monkeypatch.setattr(threads, "CpuWindow", LookOfExactlyLookS)
    before = torch.get_num_threads()
    try:
        args = ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=2", f"report.runs_dir={tmp_path / 'runs'}"]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        assert "threads: 1 of 2 cores: other processes are using" in " ".join(result.output.split())
        run_dir = next((tmp_path / "runs").glob("*/*"))
        cpu = json.loads((run_dir / "env.json").read_text())["cpu"]
        assert cpu["torch_threads"] == 1 and cpu["threads_chosen"].startswith("threads: 1 of 2 cores: other")
        # the report says why too (it said only "torch threads 1": a new user could not tell why)
        assert "torch threads 1 (inter-op" in (report := (run_dir / "report.md").read_text())
        assert "; threads: 1 of 2 cores: other processes are using" in report
        assert f"| history | {run_dir.name} alone (no restarts) |" in report  # was "n/a" beside report.json's history
    finally:
        torch.set_num_threads(before)


def test_a_resumed_run_takes_the_threads_the_run_it_continues_took(tiny, monkeypatch):
    """A new user's run stopped beside a busy neighbour (1 thread of 2) and resumed on a quiet machine
    took 2 threads: 39 of its 60 losses then differed from an uninterrupted run's, where the README
    says they are equal bit for bit. The continuation now takes the interrupted run's threads, and
    says so; train.threads still decides where it is set."""
    from accelrun.config import load_config
    from accelrun.report.metrics import read_metrics
    from accelrun.train import entry
    from tests.conftest import DEFAULT_CONFIG

    monkeypatch.delenv("ACCELRUN_FIXED_THREADS", raising=False)
    machine = {"busy": True}
    monkeypatch.setattr(entry, "choose_threads", lambda: threads.ThreadChoice(
        1 if machine["busy"] else 2, 2, 1.0 if machine["busy"] else 0.0))
    printed: list[str] = []

    class Console:
        def print(self, text, *args, **kwargs):
            printed.append(str(text))

    def run(name, resume="auto", **kw):
        recipe = load_config(DEFAULT_CONFIG, tiny(8, "checkpoint.every=2", f"name={name}",
                                                  f"checkpoint.resume={resume}"))
        return entry.train(recipe, command="test", console=Console(), **kw)

    before = torch.get_num_threads()
    try:
        reference = run("ref")  # busy all along: 1 thread
        cut = run("cut", stop_after_step=5)
        machine["busy"] = False
        printed.clear()
        resumed = run("cut")
        assert resumed.report["first_step"] == 5  # from the step-4 checkpoint
        env = json.loads((resumed.run_dir / "env.json").read_text())["cpu"]
        assert env["torch_threads"] == 1, env
        assert any("threads: 1, as the run it continues took" in line for line in printed), printed
        assert "2 would be taken now" in env["threads_chosen"]
        losses = [[m["loss"] for m in read_metrics(r.run_dir / "metrics.jsonl")] for r in (reference, resumed)]
        assert losses[1] == losses[0][4:]
        fresh = run("other")  # nothing to continue: the cores free now
        assert json.loads((fresh.run_dir / "env.json").read_text())["cpu"]["torch_threads"] == 2
        # a checkpoint named that starts a new run (an older step of the finished reference): not continued
        from accelrun.train.checkpoint import complete_checkpoints

        older = run("ref-again", resume=str(complete_checkpoints(reference.run_dir / "checkpoints")[0].path))
        assert json.loads((older.run_dir / "env.json").read_text())["cpu"]["torch_threads"] == 2
        assert cut.status == "stopped"
    finally:
        torch.set_num_threads(before)

"""`runs list` shows every kind of run folder (train, `compile explain`, `accelrun ab`) with the job's
processes, and `compile explain` shows, per region, which executors declined it and why (issue 30, item 8)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner

from accelrun.cli.compile_cmd import region_rows
from accelrun.cli.main import cli
from accelrun.compile.record import RegionRecord
from accelrun.report.runs_index import list_run_rows
from tests.conftest import DEFAULT_CONFIG


def _folder(path, **files):
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name.replace("__", "/")).parent.mkdir(parents=True, exist_ok=True)
        (path / name.replace("__", "/")).write_text(text)
    return path


def test_runs_list_has_train_explain_and_ab_rows_with_processes(tmp_path):
    runs = tmp_path / "runs"
    config = "name: llama-debug\nparallel:\n  nnodes: 1\n  nproc_per_node: 2\ncompile:\n  backend: eager\n"
    _folder(runs / "llama-debug" / "20260101-120000-aaaaaa", **{"config.yaml": config, "report.json": json.dumps(
        {"status": "finished", "steps": 5, "world_size": 2, "step_time_s": {"median": 0.1}})})
    _folder(runs / "llama-debug-explain" / "20260101-120100-bbbbbb",
            **{"config.yaml": config, "compile__record.json": "{}"})
    _folder(runs / "ab" / "llama-debug" / "20260101-120200-cccccc",
            **{"ab.json": json.dumps({"exit_code": 0, "steps": 20, "verdicts": []})})
    rows = list_run_rows(runs)
    assert [(r.kind, r.status, r.processes) for r in rows] == [
        ("ab", "finished", None), ("explain", "finished", 1), ("train", "finished", 2)]
    assert rows[0].run == "ab/llama-debug/20260101-120200-cccccc"  # the path under runs/, as the others'
    table = CliRunner().invoke(cli, ["runs", "list", str(runs)])
    assert table.exit_code == 0 and "procs" in table.stdout and "explain" in table.stdout, table.output
    assert len(list_run_rows(runs, limit=2)) == 2
    # an ab stopped by Ctrl-C (it compared the rounds it finished), listed from its own name's folder too
    _folder(runs / "ab" / "llama-debug" / "20260101-120300-dddddd",
            **{"ab.json": json.dumps({"exit_code": 130, "steps": 20, "verdicts": []})})
    rows = list_run_rows(runs / "ab", "llama-debug")
    assert [(r.kind, r.status) for r in rows] == [("ab", "interrupted"), ("ab", "finished")]
    # one whose variants' losses disagree (exit 4) ran whole: not "failed", as a variant that crashed (5) is
    for run_id, code in (("20260101-120400-eeeeee", 4), ("20260101-120500-ffffff", 5)):
        _folder(runs / "ab" / "llama-debug" / run_id, **{"ab.json": json.dumps({"exit_code": code, "steps": 20})})
    assert [r.status for r in list_run_rows(runs / "ab", "llama-debug", limit=2)] == ["failed", "losses differ"]
    # a runs folder that is itself named ab holds training runs, known by what they hold
    other = tmp_path / "exp" / "ab"
    _folder(other / "llama-debug" / "20260101-120000-aaaaaa", **{"config.yaml": config, "report.json": json.dumps(
        {"status": "finished", "steps": 5, "world_size": 2, "step_time_s": {"median": 0.1}})})
    assert [(r.kind, r.status) for r in list_run_rows(other)] == [("train", "finished")]


def test_explain_lists_each_region_with_who_declined_it(tiny, tmp_path):
    r = CliRunner().invoke(cli, ["compile", "explain", str(DEFAULT_CONFIG), *tiny(1),
                                 "compile.passes=[dce, partition_regions]", "compile.executors=[triton, aten]",
                                 "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert "each region: who took it, who declined and why" in r.stdout
    assert "triton: no CUDA" in " ".join(r.stdout.split()), r.stdout
    (row,) = [row for row in list_run_rows(tmp_path / "runs") if row.kind == "explain"]  # and it is listed
    assert row.status == "finished"
    # decided as a run of the recipe would (it said "compile.cuda_graphs = off" under the default auto)
    cuda_graphs = json.loads((Path(row.path) / "compile" / "record.json").read_text())["summary"]["cuda_graphs"]
    assert cuda_graphs["mode"] == "auto" and "CUDA graphs need a CUDA device" in cuda_graphs["run"]["reason"]


def test_region_rows_name_every_decline():
    regions = [RegionRecord("g0.forward", 3, ["add", "mul", "exp", "sum", "div"], "aten",
                            {"triton": "no CUDA device", "cpp": "compiler failed"}, 0.1)]
    assert region_rows(regions, 40) == [("g0.forward", "3", "5 (add, mul, exp, sum, …)", "aten",
                                         "triton: no CUDA device; cpp: compiler failed")]


def test_runs_list_marks_an_mfu_against_a_peak_probed_on_a_busy_machine_as_an_upper_bound(tmp_path):
    """A new user's finding (2026-12-06): report.md said the MFU was an upper bound (its CPU peak was
    probed while others used the CPU) and `runs list` showed the same figure as if it were not."""
    from accelrun.report.peak import BUSY_PEAK

    runs = tmp_path / "runs"
    config = "name: llama-debug\ncompile:\n  backend: eager\n"
    for run_id, source, mfu in (("20260101-120000-aaaaaa", f"{BUSY_PEAK}: float32 probe", 0.61),
                                ("20260101-130000-bbbbbb", "measured: float32 probe", 0.42)):
        _folder(runs / "llama-debug" / run_id, **{"config.yaml": config, "report.json": json.dumps(
            {"status": "finished", "steps": 5, "step_time_s": {"median": 0.1}, "mfu": mfu,
             "peak": {"tflops": 0.1, "source": source}})})
    rows = {r.run.split("/")[-1][:15]: r for r in list_run_rows(runs)}
    assert rows["20260101-120000"].mfu_upper_bound and not rows["20260101-130000"].mfu_upper_bound
    table = CliRunner().invoke(cli, ["runs", "list", str(runs)])
    assert table.exit_code == 0, table.output
    text = " ".join(table.stdout.split())
    assert "≤ 61.0 %" in text and "≤ 42.0 %" not in text and "42.0 %" in text, table.stdout
    assert "an upper bound" in text, table.stdout


def test_runs_list_shows_no_figure_for_an_mfu_over_100_percent(tmp_path):
    """A trial (2026-12-07): "≤ 121.4 %" for a run whose busy-machine peak was below what it achieved:
    a bound over 100% says nothing, and read as a contradiction. It shows "> 100%", and why."""
    from accelrun.report.peak import BUSY_PEAK

    runs = tmp_path / "runs"
    _folder(runs / "llama-debug" / "20260101-120000-aaaaaa", **{
        "config.yaml": "name: llama-debug\ncompile:\n  backend: eager\n", "report.json": json.dumps(
            {"status": "finished", "steps": 5, "step_time_s": {"median": 0.1}, "mfu": 1.214,
             "peak": {"tflops": 0.0864, "source": f"{BUSY_PEAK}: float32 probe"}})})
    table = CliRunner().invoke(cli, ["runs", "list", str(runs)])
    text = " ".join(table.stdout.split())
    assert table.exit_code == 0 and "121" not in text, table.stdout
    assert "> 100%" in text and "the peak it divides by is too low" in text, table.stdout
    assert "an upper bound" not in text, table.stdout


def test_a_run_killed_before_its_report_keeps_the_upper_bound_from_env_json(tmp_path):
    """A new user's finding (2026-12-07): a 2-rank run stopped by a kill wrote no report, and `runs list`
    showed its MFU without the "≤" that its finished twin had."""
    from accelrun.report.peak import BUSY_PEAK

    run = _folder(tmp_path / "runs" / "llama-debug" / "20260101-120000-aaaaaa", **{
        "config.yaml": "name: llama-debug\ncompile:\n  backend: eager\n",
        "env.json": json.dumps({"peak": {"tflops": 0.1, "source": f"{BUSY_PEAK}: float32 probe"}}),
        "metrics.jsonl": "".join(json.dumps({"step": i, "loss": 5.0, "step_time_s": 0.1, "mfu": 0.5}) + "\n"
                                 for i in range(1, 9))})
    [row] = list_run_rows(run.parent.parent)
    assert row.status == "interrupted" and row.mfu is not None and row.mfu_upper_bound, row


def test_explain_says_it_compiles_with_accelrun_whatever_the_recipes_backend(tiny):
    """A new user's finding: `compile explain ... compile.backend=eager` compiled with accelrun and said
    nothing of the backend asked for."""
    r = CliRunner().invoke(cli, ["compile", "explain", str(DEFAULT_CONFIG), *tiny(1), "compile.backend=eager",
                                 "compile.executors=[aten]", "--steps", "1"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert ("note: compile explain compiles with accelrun's compiler; compile.backend = eager (override "
            "'compile.backend=eager') is not used here") in said, said


def test_explain_times_its_steps_on_the_threads_training_would_take(tiny):
    """A new user's finding: explain kept torch's default threads with train.threads=1 set (0.50 s a step
    where training took 0.06), and then recommended train.threads=1 for a busy machine."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        r = CliRunner().invoke(cli, ["compile", "explain", str(DEFAULT_CONFIG), *tiny(1), "train.threads=1",
                                     "compile.executors=[aten]", "--steps", "1"])
        assert r.exit_code == 0, r.output
        assert "compiled step (median, 1 thread)" in " ".join(r.output.split()), r.output
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_job_folder_shows_when_it_started_and_sorts_by_it(tmp_path):
    """A multi-node job's folder is named by its job id: `runs list` showed "?" as its start and listed
    it above every newer run (its name sorted after the digits of theirs). The first node to make the
    folder writes its start; a requeue keeps it; a job folder from before that file takes its oldest
    file's time."""
    import calendar
    import os
    import time

    from accelrun.report.rundir import STARTED_FILE, job_run_dir, list_runs

    runs = tmp_path / "runs"
    config = "name: llama-debug\ncompile:\n  backend: eager\ntrain:\n  precision: fp32\n"
    report = json.dumps({"status": "finished", "steps": 5, "step_time_s": {"median": 0.1}})
    job = job_run_dir(runs, "llama-debug", "j42")
    written = (job / STARTED_FILE).read_text()
    (job / STARTED_FILE).write_text("20260101-120500\n")  # as if made then
    assert job_run_dir(runs, "llama-debug", "j42") == job and (job / STARTED_FILE).read_text() == "20260101-120500\n"
    assert time.strptime(written.strip(), "%Y%m%d-%H%M%S")  # what the first node wrote: now, in UTC
    for name, text in (("config.yaml", config), ("report.json", report)):
        (job / name).write_text(text)
    _folder(runs / "llama-debug" / "20260101-120000-aaaaaa", **{"config.yaml": config, "report.json": report})
    _folder(runs / "llama-debug" / "20260101-121000-bbbbbb", **{"config.yaml": config, "report.json": report})
    old = _folder(runs / "llama-debug" / "job-old", **{"config.yaml": config, "report.json": report})
    for f in old.iterdir():  # made at 11:00 UTC that day
        os.utime(f, (calendar.timegm(time.strptime("20260101-110000", "%Y%m%d-%H%M%S")),) * 2)
    # an older job folder entered again (requeued) gets its start file from its files, not from now
    assert job_run_dir(runs, "llama-debug", "old") == old and (old / STARTED_FILE).read_text() == "20260101-110000\n"
    rows = list_run_rows(runs)
    assert [(r.run.split("/")[-1], r.started) for r in rows] == [
        ("20260101-121000-bbbbbb", "2026-01-01 12:10"), ("job-j42", "2026-01-01 12:05"),
        ("20260101-120000-aaaaaa", "2026-01-01 12:00"), ("job-old", "2026-01-01 11:00")]
    assert [p.name for p in list_runs(runs, "llama-debug")] == [r.run.split("/")[-1] for r in rows]
    table = CliRunner().invoke(cli, ["runs", "list", str(runs)])
    assert table.exit_code == 0 and "?" not in table.stdout, table.output


def test_explain_beside_a_busy_neighbour_says_its_times_are_unreliable(tiny, monkeypatch):
    # a new user's explain: its compiled step read 1.94 s, then 0.38 s, with nothing said of the neighbour
    import accelrun.train.explain_step as explain_step

    class Busy:
        def others_share(self) -> float:
            return 0.45

    monkeypatch.setattr(explain_step, "CpuWindow", Busy)
    r = CliRunner().invoke(cli, ["compile", "explain", str(DEFAULT_CONFIG), *tiny(1),
                                 "compile.passes=[dce, partition_regions]", "--steps", "1"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.stdout.split())
    assert "warning: other processes used 45% of this machine's CPU during these steps: the times above are " \
           "slower and vary more than on a quiet machine" in said, said

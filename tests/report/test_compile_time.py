"""Compile time from the compiler's own timers (report/compile_time.py), in the report, `compare` and the
terminal: a cold run on a busy machine said "compile time 0.0" while its stage rows summed to 1.5 s."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from accelrun.report.compile_time import compile_time, record_seconds

# The walk-through's cold run: the compiling first step (3.04 s) was shorter than the median (3.41 s).
BUSY_STEPS = [{"step": 1, "step_time_s": 3.04, "compile": True}] + [
    {"step": i, "step_time_s": t, "compile": False} for i, t in enumerate([3.41, 3.2, 3.6, 3.41], start=2)]
STAGES = {"pre_grad passes": 0.07, "aot trace": 0.94, "lowering": 0.49}


def test_the_compilers_timers_win_over_a_negative_step_difference():
    took = compile_time(BUSY_STEPS, record_seconds({"stage_seconds": STAGES}))
    assert took.seconds == pytest.approx(1.5)  # before: max(3.04 - 3.41, 0) = 0.0
    assert "stage timers" in took.how and "0.00 s" in took.how


def test_a_step_difference_above_the_timers_is_kept_and_said():
    steps = [{**BUSY_STEPS[0], "step_time_s": 9.0}, *BUSY_STEPS[1:]]
    took = compile_time(steps, 1.5)
    assert took.seconds == pytest.approx(9.0 - 3.41) and "above the compiler's own stage timers" in took.how


def test_without_a_record_the_step_difference_is_all_there_is():
    assert compile_time(BUSY_STEPS, record_seconds(None)).seconds == 0.0
    assert record_seconds({"stage_seconds": {}}) is None


def test_compare_reads_the_timers_of_a_report_that_said_zero(tmp_path):
    from accelrun.report.compare import _compile_time
    from accelrun.report.rundata import RunRecord

    report = {"compile_time_s": 0.0, "compiler": {"stage_seconds": STAGES}}
    record = RunRecord(path=tmp_path / "run", config={}, sources={}, env={}, metrics=BUSY_STEPS, report=report)
    assert _compile_time(record) == pytest.approx(1.5)


def test_the_terminal_says_compile_time_and_a_graph_cache_error():
    from accelrun.train.run import _print_summary

    report = {"step_time_s": {"median": 3.41}, "first_loss": 5.0, "final_loss": 4.0, "tokens_per_s_job": 100.0,
              "compile_time_s": 1.5, "compiler": {
                  "compiled": "2 graphs, 13 fusion regions (cpp 13)",
                  "graph_cache": {"errors": ["ab.pt compiled again: ab.py changed since it was compiled"]}}}
    out = io.StringIO()
    _print_summary(Console(file=out, width=400), report, Path("run"))
    text = out.getvalue()
    assert "compiled: 2 graphs, 13 fusion regions (cpp 13); compile 1.5 s" in text
    lines = [ln for ln in text.splitlines() if "graph cache:" in ln]
    assert lines == ["graph cache: ab.pt compiled again: ab.py changed since it was compiled"]


def test_a_compiled_run_reports_what_its_compiler_timed(tiny):
    """A real cold run through accelrun's compiler and the graph cache: the compile time is at least the
    stages the compiler timed (Dynamo's tracing among them), and report.md's figures agree."""
    from accelrun.config import load_config
    from accelrun.train.entry import train
    from tests.conftest import DEFAULT_CONFIG

    overrides = tiny(3, "checkpoint.enabled=false", "compile.backend=accelrun", "compile.scope=loss",
                     "compile.executors=[cpp,aten]")
    result = train(load_config(DEFAULT_CONFIG, overrides), command="test")
    report = json.loads((result.run_dir / "report.json").read_text())
    compiler = report["compiler"]
    assert compiler["graph_cache"]["compiled"] == 2 and compiler["stage_seconds"]["dynamo trace"] > 0
    assert report["compile_time_s"] >= record_seconds(compiler) > 0
    assert any(n.startswith("compile time = ") for n in report["notes"])
    md = (result.run_dir / "report.md").read_text()
    assert "compile time (apart) | 0.0 ms" not in md
    assert "| Dynamo frames seen / given a graph / skipped | 2 / 2 / 0 (2 traced to be saved in the graph cache) |" in md


def test_frames_dynamo_took_with_nothing_in_them_are_said_so_beside_no_graph():
    """A trial read "Dynamo frames seen / given a graph / skipped 8 / 6 / 2" beside "graphs compiled 0"
    as a contradiction: the 6 held no tensor operation (module call wrappers around skipped frames)."""
    from accelrun.report.markdown import compiler_rows

    summary = {"dynamo_graphs": 0, "graph_breaks": 1,
               "dynamo": {"frames_seen": 8, "frames_compiled": 6, "frames_skipped": ["a", "b"]}}
    rows = dict(compiler_rows(summary))
    assert rows["Dynamo frames seen / given a graph / skipped"] == "8 / 6 / 2 (no tensor operation in them to compile)"
    summary["dynamo_graphs"] = 2
    assert dict(compiler_rows(summary))["Dynamo frames seen / given a graph / skipped"] == "8 / 6 / 2"

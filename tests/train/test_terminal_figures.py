"""What the terminal says about throughput: the job's figures lead (as in report.md and `runs list`), and
a run too short for steady-state figures says why they are n/a (issue 30, items 1 and 6)."""

from __future__ import annotations

import io
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from accelrun.cli.main import cli
from accelrun.train.progress import TrainProgress
from accelrun.train.run import _print_summary
from tests.conftest import DEFAULT_CONFIG


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=300, highlight=False, soft_wrap=True), buf


def _report(**figures) -> dict:
    return {"first_loss": 5.0, "final_loss": 4.0, "step_time_s": {"median": 0.5}, "mfu": 0.1,
            "tokens_per_s": 2187.0, "tokens_per_s_job": 4374.0, "world_size": 2, **figures}


def test_summary_leads_with_the_jobs_tokens_per_second():
    console, buf = _console()
    _print_summary(console, _report(), Path("runs/x"))
    line = buf.getvalue()
    assert "4,374 tok/s (job; a share of 2,187 a rank × 2)" in line, line
    assert line.index("4,374") < line.index("2,187")
    # under TP or PP a rank computes all its group's tokens: the figure is said to be a split, not its work
    console, buf = _console()
    _print_summary(console, _report(parallel={"pp": 1, "dp_shard": 1, "tp": 2}), Path("runs/x"))
    assert "(job; the job's tokens split evenly, not what each computes: 2,187 a rank × 2)" in buf.getvalue()


def test_summary_of_one_process_shows_one_figure():
    console, buf = _console()
    _print_summary(console, _report(tokens_per_s=2739.0, tokens_per_s_job=2739.0, world_size=1), Path("runs/x"))
    assert "2,739 tok/s;" in buf.getvalue() and "per rank" not in buf.getvalue()


def test_progress_lines_show_the_jobs_tokens_per_second():
    console, buf = _console()
    progress = TrainProgress(10, 0, "lines", 1, console, ranks=2)
    progress.update(1, 5.0, 2187.0)  # rank 0's figure, as the loop passes it
    assert "4,374 tok/s (job, 2 ranks)" in buf.getvalue(), buf.getvalue()


def test_a_run_of_only_warmup_steps_says_why_its_figures_are_na(tiny):
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG),
                                 *tiny(2, "checkpoint.enabled=false", "report.warmup_steps=5")])
    assert r.exit_code == 0, r.output
    done = r.stderr[r.stderr.index("done"):]
    assert "n/a tok/s" in done
    assert "no steady-state steps: 2 steps, of which the first 2 are warm-up" in done, done


def test_a_run_compiled_by_inductor_says_so_at_the_end_as_accelrun_does():
    """Inductor's run ended without the "compiled:" line the README describes (its compile section has
    graph breaks only)."""
    console, buf = _console()
    report = _report(world_size=1, compiled="4 transformer blocks with inductor", compile_time_s=10.5,
                     compiler={"graph_breaks": 1, "graph_break_reasons": {"x": 1}, "graphs_in_use": 1})
    _print_summary(console, report, Path("runs/x"))
    assert "  compiled: 4 transformer blocks with inductor, 1 graph break(s); compile 10.5 s" in buf.getvalue()


def test_the_eta_in_lines_is_the_pace_after_the_first_step(monkeypatch):
    """The first step compiles (13 s with Inductor): an ETA from it said 04:30 for a 27 s run."""
    import accelrun.train.progress as progress

    clock = iter([0.0, 13.0, 14.0, 15.0])  # made at 0; step 1 ends at 13 s; then 1 s a step
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    console, buf = _console()
    bar = TrainProgress(total=12, start=0, mode="lines", every=1, console=console)
    for step in (1, 2, 3):
        bar.update(step, 5.0, 100.0)
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith("eta --:--") and lines[1].endswith("eta 00:10") and lines[2].endswith("eta 00:09"), lines


def test_a_ranks_console_keeps_long_lines_whole():
    """Under two processes the model, MFU-peak and resume lines broke at 80 columns in the terminal and
    in logs/rank-0.log (a new user, 2026-12-06): a rank's console soft-wraps as one process's does."""
    import io

    from accelrun.train.rank import rank_console

    console = rank_console()
    console.file = io.StringIO()
    line = "model 3.55 M params on cpu; " + "compile: 4 repeated blocks " * 8
    console.print(line)
    assert console.file.getvalue() == line + "\n"


def test_report_md_names_the_parallel_switches_with_an_inferred_pipeline_degree():
    from accelrun.config import load_config
    from accelrun.train.run import parallel_said
    from tests.conftest import DEFAULT_CONFIG

    cfg = load_config(DEFAULT_CONFIG, ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=-1",
                                       "compile.backend=eager"]).config  # fmt: skip
    assert parallel_said(cfg.parallel) == "pp 2 × dp_replicate 1 × dp_shard 1 × cp 1 × tp 1; 1f1b schedule"

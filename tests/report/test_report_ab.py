"""The ab verdict line, its schedule and forced overrides, and the busy-machine meter (no processes run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelrun.report import machine_load
from accelrun.report.ab import AbPlan, Variant, compile_warnings, verdict_line
from accelrun.report.compare import Group, GroupFigures
from accelrun.report.parity import LossParity
from accelrun.report.rundata import RunRecord
from accelrun.report.stats import RatioCI


def row(label, ci=None, parity=None, cause=""):
    return GroupFigures(label=label, runs=3, status="finished", steady_steps=75, median_step_s=0.1,
                        tokens_per_s=1000.0, mfu=None, mem_peak_bytes=None, compile_time_s=None, final_loss=2.0,
                        speedup=ci, parity=parity, parity_cause=cause)


def ci(ratio, low, high):
    return RatioCI(ratio, low, high, 0.95, 2000, (3, 3))


AGREE = LossParity("agree", 30, 1e-3, 1e-5)
A = row("A")


def test_faster_slower_and_no_difference_verdicts():
    assert (verdict_line(row("B", ci(1.234, 1.19, 1.27), AGREE), A, 3)
            == "B is 1.23× faster than A (95% CI 1.19–1.27); losses agree")
    # Slower: the ratio and the interval are turned around so the number reads as "times slower".
    assert (verdict_line(row("B", ci(0.8, 0.75, 0.85), AGREE), A, 3)
            == "B is 1.25× slower than A (95% CI 1.18–1.33); losses agree")
    # A narrow interval gets a third digit rather than "1.00–1.01".
    assert verdict_line(row("B", ci(1.004, 1.001, 1.007), AGREE), A, 3).startswith(
        "B is 1.004× faster than A (95% CI 1.001–1.007)")
    # No significant difference: the interval, then what more repeats would buy. An interval much
    # wider than the difference seen says how small a difference it could show, not "resolve 72%".
    assert (verdict_line(row("B", ci(1.02, 0.62, 1.68), AGREE), A, 3)
            == "no significant difference: B at 1.02× A's speed (95% CI 0.62–1.68): differences under 65% do not "
               "show at this noise; 9 more repeats would bring that to about 28%, a quieter machine lower still; "
               "losses agree")
    assert (verdict_line(row("B", ci(1.04, 0.99, 1.09), AGREE), A, 3)
            == "no significant difference: B at 1.04× A's speed (95% CI 0.99–1.09); about 2 more repeats could "
               "show its 4.0% difference, if it holds; losses agree")
    # A slower B: the difference its ratio shows (4%), one repeat said in the singular, and an interval
    # of no width (every step the same) asks for none.
    assert "about 1 more repeat could show its 4.0% difference" in verdict_line(row("B", ci(0.96, 0.93, 1.005), AGREE), A, 9)
    assert verdict_line(row("B", ci(1.0, 1.0, 1.0), AGREE), A, 3) == ("no significant difference: B at 1.000× A's "
                                                                      "speed (95% CI 1.000–1.000); losses agree")
    assert verdict_line(row("C", ci(1.01, 0.95, 1.07), AGREE), A, 3, multi=True).startswith("C vs A: no significant")
    assert "too few steady steps" in verdict_line(row("B", None, AGREE), A, 3)


def test_an_interval_over_two_repeats_is_no_verdict():
    """An interval over the steps of one or two processes does not cover how much a new process's pace
    moves: a trial's ab said "B is 1.22x slower (95% CI 1.07-1.31)" and, rerun, "B is 1.37x faster
    (1.11-1.64)" of the same compiled graphs. Under 3 repeats what was seen is said, not called."""
    line = verdict_line(row("B", ci(0.82, 0.76, 0.93), AGREE), A, 2)
    assert line == ("B ran 1.22× slower than A in 2 repeat(s) (95% CI 1.08–1.32 over their steps): too few repeats "
                    "to call a difference; --repeats 3 or more; losses agree")
    assert "is 1.37× faster" in verdict_line(row("B", ci(1.37, 1.11, 1.64), AGREE), A, 3)


def test_each_variants_compile_warnings_are_said_once():
    """Variant B's graph break was printed by its runs and missing from ab.md (a new user's trial)."""
    def run(warnings):
        return RunRecord(Path("r"), {}, {}, {}, [], {"compiler": {"warnings": warnings}})

    brk = "1 graph break(s): ... at models/m3.py:63"
    interrupted = RunRecord(Path("r"), {}, {}, {}, [], None)  # no report
    groups = [Group("A", [run([]), run([])]), Group("B", [run([brk]), run([brk])]), Group("C", [interrupted])]
    assert compile_warnings(groups) == [f"variant B: {brk}"]


def test_disagreeing_losses_name_the_step_and_the_cause():
    differ = LossParity("differ", 30, 1e-3, 0.03, 2, (5.6118, 5.4386))
    line = verdict_line(row("B", ci(1.0, 0.9, 1.1), differ, "expected: train.seed differs"), A, 3)
    assert line.endswith("; losses disagree: B parts from A at step 2 (5.6118 vs 5.4386); "
                         "expected: train.seed differs")


def test_schedule_interleaves_and_forced_overrides_come_last(tmp_path):
    plan = AbPlan("cfg.yaml", [Variant("A", []), Variant("B", ["x=1"]), Variant("C", ["y=2"])], tmp_path,
                  common=["z=3"], repeats=2, steps=7, warmup_steps=2)
    assert [f"{v.label}{r}" for r, v in plan.schedule()] == ["A1", "B1", "C1", "A2", "B2", "C2"]
    ov = plan.overrides(plan.variants[1])
    assert ov[:2] == ["z=3", "x=1"]
    assert ov[2:] == ["train.steps=7", f"report.runs_dir={tmp_path / 'runs'}", "checkpoint.enabled=false",
                      "checkpoint.hf_on_finish=false", "checkpoint.resume=none", "report.progress=lines", "report.warmup_steps=2"]
    # a key ab sets itself is named once in the child's command: ab's value (found by a new user)
    mine = AbPlan("cfg.yaml", [Variant("A", ["~checkpoint.resume"])], tmp_path, common=["report.runs_dir=mine", "z=3"])
    ov = mine.overrides(mine.variants[0])
    assert [o for o in ov if o.startswith(("report.runs_dir", "~checkpoint.resume", "checkpoint.resume"))] == \
        [f"report.runs_dir={tmp_path / 'runs'}", "checkpoint.resume=none"] and ov[0] == "z=3"


def test_other_cpu_meter_subtracts_our_own_cpu_time(monkeypatch):
    busy, own = iter([10.0, 14.0]), iter([1.0, 2.0])
    monkeypatch.setattr(machine_load, "_busy_cpu_s", lambda: next(busy))
    monkeypatch.setattr(machine_load, "_own_cpu_s", lambda: next(own))
    # The window's wall time, not the process's clock (other threads read time.perf_counter too).
    monkeypatch.setattr(machine_load.CpuWindow, "wall_s", lambda self: 2.0)
    monkeypatch.setattr(machine_load.os, "cpu_count", lambda: 2)
    meter = machine_load.OtherCpuMeter()
    # 4 s of CPU used in 2 s on 2 cores; 1 s of it was ours: others used 3 of 4 core-seconds.
    assert meter.share() == 0.75


def test_other_cpu_meter_on_this_machine():
    meter = machine_load.OtherCpuMeter()
    sum(i * i for i in range(200_000))
    share = meter.share()
    assert share is None or 0.0 <= share <= 1.0
    if Path("/proc/stat").exists():
        assert share is not None


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")
def test_a_window_counts_its_running_children_as_its_own():
    """A compile's helpers (g++, Inductor's workers, which live until the process ends) are the run's
    work: a short Inductor run on a quiet machine warned that others used 39% of the CPU. A child that
    burns half a second of CPU, still running when read, is counted as the window's own. In a process
    of its own: a test worker's other descendants (earlier tests' pools) come and go meanwhile."""
    import subprocess
    import sys

    script = """
import os, subprocess, sys, time
from accelrun.report import machine_load
window = machine_load.CpuWindow()
child = subprocess.Popen([sys.executable, "-c", "import time\\nt = time.process_time()\\n"
                          "while time.process_time() - t < 0.5: pass\\ntime.sleep(60)"])
deadline = time.monotonic() + 60
while machine_load._live_descendants_cpu_s(os.getpid()) < 0.5 and time.monotonic() < deadline:
    time.sleep(0.05)
print(window.own_s())
child.kill()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout.strip()) >= 0.5, out  # the child's half second, read while it still runs


def test_the_variants_recipe_warnings_are_said_before_the_runs(tmp_path):
    """A trial's `ab --steps 15` on a recipe warming up for 30 steps: every variant trained without ever
    reaching its learning rate, and the warning was only in the runs' logs. validate's warnings are now
    the plan's notes, a warning of every variant said once."""
    from accelrun.report.ab import resolve_variants

    repo = Path(__file__).resolve().parents[2]
    plan = AbPlan(str(repo / "configs" / "llama.yaml"), [Variant("A", ["compile.backend=eager"]),
                  Variant("B", ["compile.backend=eager", "compile.scope=block"])], tmp_path / "ab",
                  steps=15, warmup_steps=2)  # fmt: skip
    resolve_variants(plan)
    warm_up = [n for n in plan.notes if "warmup_steps = 30" in n]
    assert len(warm_up) == 1 and warm_up[0].startswith("every variant: train.lr_schedule.warmup_steps"), plan.notes
    # B's own: compile.scope means nothing without the compiler
    assert any(n.startswith("variant B: compile.scope") for n in plan.notes), plan.notes
    # an A/A run's twin (its config validated once, as A's) warns as A does: still "every variant"
    twin = AbPlan(plan.config, [Variant("A", ["compile.backend=eager"]), Variant("C", ["compile.backend=eager"])],
                  tmp_path / "aa", steps=15, warmup_steps=2)
    resolve_variants(twin)
    assert any(n.startswith("every variant: train.lr_schedule.warmup_steps") for n in twin.notes), twin.notes


def test_a_variants_recipe_error_names_the_variant(tmp_path):
    """`--b parallel.dp_shard=1 parallel.tp=2` refused with the recipe's message alone (a new user's trial)."""
    from accelrun.config import ConfigError
    from accelrun.report.ab import resolve_variants

    repo = Path(__file__).resolve().parents[2]
    plan = AbPlan(str(repo / "configs" / "llama.yaml"), [Variant("A", ["compile.backend=eager"]),
                  Variant("B", ["parallel.dp_shard=1", "parallel.tp=3"])], tmp_path / "ab", steps=15, warmup_steps=2)
    with pytest.raises(ConfigError) as raised:
        resolve_variants(plan)
    assert raised.value.messages[0].startswith("variant B: parallel degrees "), raised.value.messages


def test_ab_resolves_a_recipe_that_exports_on_finish(tmp_path):
    """configs/hf-llama.yaml exports the final checkpoint (checkpoint.hf_on_finish); ab's runs keep no
    checkpoint, so ab turns the export off too instead of refusing the recipe before it starts."""
    from accelrun.report.ab import resolve_variants
    from tests.models.hf_helpers import save_tiny_hf

    save_tiny_hf(tmp_path / "m", "llama")
    repo = Path(__file__).resolve().parents[2]
    plan = AbPlan(str(repo / "configs" / "hf-llama.yaml"), [Variant("A", ["compile.backend=eager"]),
                  Variant("B", ["compile.backend=accelrun"])], tmp_path / "ab",
                  common=[f"model.hf={tmp_path / 'm'}", "data.tokenizer=byte", "train.seq_len=32"])  # fmt: skip
    resolved = resolve_variants(plan)
    assert [r.config.compile.backend for r in resolved] == ["eager", "accelrun"]
    assert not any(r.config.checkpoint.hf_on_finish or r.config.checkpoint.enabled for r in resolved)


def test_beside_a_busy_neighbour_every_variant_runs_on_the_cores_left(tmp_path, monkeypatch):
    """On every core beside a busy neighbour a new user's variants swung from 0.3 to 4 s a step and the
    interval spanned 0.2-5.8x, where `accelrun train` alone takes the cores left. ab now takes them once,
    for every variant alike, unless a recipe or override sets train.threads."""
    from accelrun.config import load_config
    from accelrun.report.ab import pin_threads_to_free_cores
    from accelrun.train.threads import ThreadChoice
    from tests.conftest import DEFAULT_CONFIG

    def plan(*common):
        p = AbPlan(str(DEFAULT_CONFIG), [Variant("A", ["compile.backend=eager"]), Variant("B", [])], tmp_path,
                   common=list(common))  # fmt: skip
        return p, [load_config(p.config, p.overrides(v)) for v in p.variants]

    monkeypatch.delenv("ACCELRUN_FIXED_THREADS")  # (the suite's setting: torch's default threads)
    busy = lambda: ThreadChoice(1, 2, 1.3)  # noqa: E731
    p, resolved = plan()
    pin_threads_to_free_cores(p, resolved, busy)
    assert "train.threads=1" in p.command(p.variants[0]) and "train.threads=1" in p.command(p.variants[1])
    assert any("every variant runs on train.threads=1, the cores left" in n for n in p.notes), p.notes
    assert p.pinned_threads == 1
    pin_threads_to_free_cores(p, [load_config(p.config, p.overrides(v)) for v in p.variants], busy)  # run_ab's again
    assert p.common.count("train.threads=1") == 1 and len(p.notes) == 1  # once
    for common in (["train.threads=2"], ["train.device=cuda"], ["parallel.nproc_per_node=2"]):  # theirs stays
        p, resolved = plan(*common)
        pin_threads_to_free_cores(p, resolved, busy)
        assert p.common == common and not p.notes
    p, resolved = plan()
    pin_threads_to_free_cores(p, resolved, lambda: ThreadChoice(2, 2, 0.1))  # a quiet machine: every core
    assert p.common == [] and not p.notes
    p, resolved = plan()  # others on both cores: no core was left, one thread all the same (a trial's case)
    pin_threads_to_free_cores(p, resolved, lambda: ThreadChoice(1, 2, 2.0))
    assert any("train.threads=1, none was free, so one" in n for n in p.notes), p.notes

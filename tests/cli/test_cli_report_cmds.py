"""``accelrun compare``, ``accelrun runs list`` and ``accelrun ab``'s arguments, verdicts and exit codes,
through click's CliRunner on short real runs (the end-to-end ``ab`` is in test_cli_ab_e2e.py)."""

from __future__ import annotations

import json
import re
import shutil
import statistics

import pytest
from click.testing import CliRunner

from accelrun.cli import ab_cmd
from accelrun.cli.main import cli
from accelrun.report.ab import AbPlan, Variant, summarize_ab
from accelrun.report.rundata import load_run
from tests.cli.test_cli_ab_e2e import VERDICT
from tests.conftest import DEFAULT_CONFIG, TINY
from tests.report.report_run_helpers import train_tiny


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-report") / "runs"
    base = train_tiny(root, 6)
    twin = train_tiny(root, 6)
    seed1 = train_tiny(root, 6, "train.seed=1", "name=seeded")
    return {"root": root, "base": base, "twin": twin, "seed1": seed1}


@pytest.mark.parametrize("cmd", [["compare"], ["ab"], ["runs"], ["runs", "list"]], ids=" ".join)
def test_help_has_examples(cmd):
    r = invoke(*cmd, "--help")
    assert r.exit_code == 0 and "Example" in r.output


def test_compare_two_runs_prints_table_parity_and_writes_reports(runs, tmp_path):
    out = tmp_path / "cmp"
    r = invoke("compare", runs["base"], runs["twin"], "--out", out)
    assert r.exit_code == 0, r.output
    assert "step time (median)" in r.stdout and "baseline" in r.stdout and "×" in r.stdout
    assert "identical over 6 steps" in r.stdout
    assert "config differences: none" in r.stdout
    for name in ("compare.md", "compare.html", "compare.json"):
        assert (out / name).is_file(), name
    page = (out / "compare.html").read_text()
    assert "<svg" in page and "<script" not in page
    assert json.loads((out / "compare.json").read_text())["losses_agree"] is True


def test_compare_a_changed_seed_shows_where_losses_part_and_the_key(runs):
    r = invoke("compare", runs["base"], runs["seed1"], "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["losses_agree"] is False
    parity = doc["rows"][1]["parity"]
    assert parity["status"] == "differ" and parity["first_step"] <= 2
    keys = {d["key"]: d for d in doc["config_diff"]}
    assert keys["train.seed"]["values"] == [0, 1] and keys["train.seed"]["sources"][1] == "override 'train.seed=1'"
    r = invoke("compare", runs["base"], runs["seed1"])
    assert re.search(r"^\s*seeded parts from llama-debug at step \d", r.stdout, re.M), r.stdout  # each name once
    assert "expected: train.seed differs" in r.stdout


def test_compare_user_errors_exit_2(runs, tmp_path):
    r = invoke("compare", runs["base"], tmp_path / "nope")
    assert r.exit_code == 2 and "run directory not found" in r.output and "Traceback" not in r.output
    r = invoke("compare", runs["base"])
    assert r.exit_code == 2 and "at least two runs" in r.output


def test_runs_list(runs, tmp_path):
    r = invoke("runs", "list", runs["root"])
    assert r.exit_code == 0, r.output
    assert r.stdout.count("finished") == 3 and "llama-debug/" in r.stdout and "seeded/" in r.stdout
    lines = invoke("runs", "list", runs["root"], "--name", "seeded", "--json").stdout.strip().splitlines()
    (row,) = [json.loads(line) for line in lines]
    assert row["status"] == "finished" and row["steps"] == 6 and row["compile"] == "eager"
    assert row["step_time_s"] > 0 and row["config_hash"]
    interrupted = tmp_path / "runs" / "llama-debug" / runs["twin"].name
    shutil.copytree(runs["twin"], interrupted)
    (interrupted / "report.json").unlink()
    rows = [json.loads(line) for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    (interrupted / "metrics.jsonl").write_text("".join(json.dumps({**m, "mfu": 0.1 * m["step"]}) + "\n" for m in rows))
    r = invoke("runs", "list", tmp_path / "runs")
    assert "interrupted" in r.stdout
    # without a report: its config's hash from config.yaml, its MFU and peak from its steps' rows
    (row,) = [json.loads(line) for line in invoke("runs", "list", tmp_path / "runs", "--json").stdout.splitlines()]
    report = json.loads((runs["twin"] / "report.json").read_text())
    assert row["status"] == "interrupted" and row["config_hash"] == report["config_hash"]
    steady = [0.1 * m["step"] for m in rows[report["warmup_steps"]:]]
    assert row["mfu"] == pytest.approx(statistics.median(steady)) and row["mem_peak_bytes"] is not None, row
    r = invoke("runs", "list", tmp_path / "none")  # a folder named that is not there: a mistake
    assert r.exit_code == 2 and "none: no such folder" in r.output
    (tmp_path / "afile").write_text("")
    r = invoke("runs", "list", tmp_path / "afile")
    assert r.exit_code == 2 and "afile: not a folder" in r.output
    (tmp_path / "empty").mkdir()
    r = invoke("runs", "list", tmp_path / "empty")
    assert r.exit_code == 0 and "no runs under" in r.stdout
    # one recipe's folder of runs, as compare, export and generate take it
    lines = invoke("runs", "list", runs["root"] / "llama-debug", "--json").stdout.strip().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["run"].startswith("llama-debug/") for line in lines)
    r = invoke("runs", "list", runs["root"] / "llama-debug", "--name", "seeded")
    assert r.exit_code == 2 and "holds the runs named llama-debug, not seeded" in r.output


def test_runs_list_counts_a_resumed_runs_steps_to_the_step_it_reached(runs, tmp_path):
    """A run resumed from step 3 of 6: its folder's report counts its own 3 steps; the row says 6."""
    first, resumed = tmp_path / "runs" / "x" / "20261201-000000-aaaaaa", tmp_path / "runs" / "x" / "20261201-000100-bbbbbb"
    rows = [json.loads(line) for line in (runs["twin"] / "metrics.jsonl").read_text().splitlines()]
    for folder, kept in ((first, rows[:4]), (resumed, rows[3:])):
        shutil.copytree(runs["twin"], folder)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    (first / "report.json").unlink()
    report = json.loads((resumed / "report.json").read_text())
    (resumed / "report.json").write_text(json.dumps({**report, "steps": 3}))
    (resumed / "lineage.json").write_text(json.dumps({"continues": str(first), "from_step": 3, "segment": 2}))
    lines = invoke("runs", "list", tmp_path / "runs", "--json").stdout.strip().splitlines()
    rows = {json.loads(line)["run"]: json.loads(line) for line in lines}
    assert {k: row["steps"] for k, row in rows.items()} == {f"x/{resumed.name}": 6, f"x/{first.name}": 4}, rows
    # its step time is the run's (both folders' steady steps), as compare's, not its last folder's report's
    from accelrun.report.compare import Group, compare_groups

    whole = compare_groups([Group("A", [load_run(runs["twin"])]), Group("B", [load_run(resumed)])]).rows[1]
    assert rows[f"x/{resumed.name}"]["step_time_s"] == pytest.approx(whole.median_step_s)


def _fake_ab(monkeypatch, run_dirs):
    """Replace the process-running part of `ab` with finished runs; record the plan it was given."""
    seen = {}

    def fake(plan, on_event, *, seed=0, loss_rtol=None):
        seen["plan"] = plan
        return summarize_ab(plan, run_dirs, seed=seed, loss_rtol=loss_rtol)

    monkeypatch.setattr(ab_cmd, "run_ab", fake)
    return seen


def test_ab_variant_options_take_every_override_up_to_the_next_option(runs, tmp_path, monkeypatch):
    seen = _fake_ab(monkeypatch, {"A": [runs["base"]], "B": [runs["twin"]]})
    r = invoke("ab", DEFAULT_CONFIG, "train.seq_len=32", "--a", "compile.backend=eager", "--b",
               "compile.backend=inductor", "train.threads=1", "--repeats", "1", "--steps", "8",
               "--out", tmp_path / "ab")
    assert r.exit_code == 0, r.output
    plan: AbPlan = seen["plan"]
    assert [v.overrides for v in plan.variants] == [["compile.backend=eager"],
                                                    ["compile.backend=inductor", "train.threads=1"]]
    assert plan.common == ["train.seq_len=32"] and plan.repeats == 1 and plan.steps == 8
    cmd = plan.command(plan.variants[1])
    assert cmd[1:4] == ["-m", "accelrun.cli.main", "train"]
    for forced in ("train.steps=8", "checkpoint.enabled=false", "checkpoint.resume=none", "report.progress=lines",
                   f"report.runs_dir={tmp_path / 'ab' / 'runs'}"):
        assert forced in cmd
    assert cmd.index("train.threads=1") < cmd.index("checkpoint.enabled=false")  # ab's own overrides win
    assert VERDICT.search(r.stdout), r.stdout
    for name in ("ab.md", "ab.html", "ab.json", "command.txt"):
        assert (tmp_path / "ab" / name).is_file(), name


def test_an_interrupted_ab_compares_the_rounds_every_variant_finished(runs, tmp_path, monkeypatch):
    """Ctrl-C in round 2 of 2: round 1 (A1, B1) is compared and reported, with a note, exit 130; Ctrl-C
    before any round finished: exit 130, and the folder keeps the command it ran."""
    from accelrun.report import ab

    finished = iter([runs["base"], runs["twin"]])

    def run_one(plan, v, repeat, *args):
        try:
            return next(finished), None
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(ab, "run_one", run_one)
    r = invoke("ab", DEFAULT_CONFIG, *TINY, "--b", "train.seed=0", "--repeats", "2", "--out", tmp_path / "ab")
    assert r.exit_code == 130, r.output
    doc = json.loads((tmp_path / "ab" / "ab.json").read_text())
    assert doc["exit_code"] == 130 and [len(g["runs"]) for g in doc["groups"]] == [1, 1]
    assert ("interrupted (Ctrl-C or a stop signal) in round 2 of 2: the figures cover the 1 round(s) every variant "
            "finished") in doc["notes"]
    assert "interrupted: compared the 1 round(s) of 2 every variant finished (exit 130)" in r.stderr
    assert (tmp_path / "ab" / "command.txt").read_text().startswith("accelrun")
    r = invoke("ab", DEFAULT_CONFIG, *TINY, "--b", "train.seed=0", "--repeats", "2", "--out", tmp_path / "none")
    assert r.exit_code == 130 and "interrupted" in r.stderr and not (tmp_path / "none" / "ab.json").exists()
    assert (tmp_path / "none" / "command.txt").is_file()


def test_ab_exits_4_when_losses_disagree(runs, tmp_path, monkeypatch):
    _fake_ab(monkeypatch, {"A": [runs["base"], runs["twin"]], "B": [runs["seed1"], runs["seed1"]]})
    r = invoke("ab", DEFAULT_CONFIG, "--b", "train.seed=1", "--repeats", "2", "--out", tmp_path / "ab")
    assert r.exit_code == 4, r.output
    assert re.search(r"; losses disagree: B parts from A at step \d .*expected: train.seed differs", r.stdout)
    doc = json.loads((tmp_path / "ab" / "ab.json").read_text())
    assert doc["exit_code"] == 4 and doc["losses_agree"] is False
    assert 'class="verdict bad"' in (tmp_path / "ab" / "ab.html").read_text()


def test_ab_user_errors_exit_2_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(ab_cmd, "run_ab", lambda *a, **k: pytest.fail("must not run"))
    r = invoke("ab", DEFAULT_CONFIG, f"report.runs_dir={tmp_path}", "--b", "trian.steps=3")
    assert r.exit_code == 2 and "did you mean 'train'" in r.output
    r = invoke("ab", DEFAULT_CONFIG, "--a", "train.steps=3")
    assert r.exit_code == 2 and "Missing option '--b'" in r.output
    # a warm-up that leaves no steady steps: every run would train and then have no speed to compare
    r = invoke("ab", DEFAULT_CONFIG, f"report.runs_dir={tmp_path}", "--b", "train.precision=bf16-mixed",
               "--steps", "20", "--warmup-steps", "25")
    assert r.exit_code == 2, r.output
    assert ("variant A: report.warmup_steps = 25 of train.steps = 20 leaves 0 steady step(s) a run, 0 over 3 "
            "repeat(s): a speed needs 2; give --steps 27 or more, or --warmup-steps 18 or fewer") in " ".join(r.output.split())
    r = invoke("ab", DEFAULT_CONFIG, f"report.runs_dir={tmp_path}", "--b", "train.seed=1", "--steps", "6",
               "--warmup-steps", "5", "--repeats", "1")  # one steady step in all: no interval either
    assert r.exit_code == 2 and "leaves 1 steady step(s) a run, 1 over 1 repeat(s)" in " ".join(r.output.split())


def test_ab_with_fewer_than_three_repeats_says_its_interval_misses_the_noise_between_processes(tmp_path):
    from accelrun.report.ab import resolve_variants

    for repeats, noted in ((1, True), (2, True), (3, False)):
        plan = AbPlan(str(DEFAULT_CONFIG), [Variant("A", []), Variant("B", ["train.seed=1"])], tmp_path,
                      common=list(TINY), repeats=repeats)
        resolve_variants(plan)
        assert any("--repeats 3 or more" in n for n in plan.notes) == noted, (repeats, plan.notes)


def test_ab_variants_that_resolve_alike_are_an_a_a_run_with_a_note(tmp_path, monkeypatch):
    from accelrun.report.ab import resolve_variants

    plan = AbPlan(str(DEFAULT_CONFIG), [Variant("A", []), Variant("B", ["compile.backend=eager"])], tmp_path,
                  common=list(TINY))
    resolve_variants(plan)
    assert len(plan.notes) == 1 and "B resolves to the same config as A" in plan.notes[0] and "A/A" in plan.notes[0]
    plan.out_dir = tmp_path / "elsewhere"  # as `accelrun ab` sets it after the first check: the note once
    resolve_variants(plan)
    assert len(plan.notes) == 1, plan.notes
    seen = []

    class Planned(Exception):
        pass

    def record(p, *args, **kwargs):
        seen.append(p)
        raise Planned

    monkeypatch.setattr(ab_cmd, "run_ab", record)
    r = invoke("ab", DEFAULT_CONFIG, *TINY, f"report.runs_dir={tmp_path}", "--a", "--b", "--repeats", "1")
    assert isinstance(r.exception, Planned) and [v.overrides for v in seen[0].variants] == [[], []]
    assert "an A/A run" in r.output


def test_ab_warns_when_other_processes_compete_for_the_cpu(runs, tmp_path):
    plan = AbPlan(str(DEFAULT_CONFIG), [Variant("A", []), Variant("B", ["train.threads=1"])], tmp_path, repeats=1)
    quiet = summarize_ab(plan, {"A": [runs["base"]], "B": [runs["twin"]]}, other_cpu={"A": [0.02], "B": [0.01]})
    assert not any("other processes" in w for w in quiet.comparison.warnings)
    busy = summarize_ab(plan, {"A": [runs["base"]], "B": [runs["twin"]]}, other_cpu={"A": [0.5], "B": [None]})
    assert busy.comparison.warnings[0].startswith("other processes used up to 50% of the CPU during the runs (A1 50%)")
    assert "torch's default threads (every core)" in busy.comparison.warnings[0]  # why not the threads train would pick
    # Given train.threads, the warning says the runs used it (it advised setting it: a new user had)
    pinned = train_tiny(tmp_path / "pinned", 6, "train.threads=1")
    busy = summarize_ab(plan, {"A": [pinned], "B": [runs["twin"]]}, other_cpu={"A": [0.5], "B": [None]})
    assert busy.comparison.warnings[0].endswith("The variants ran on train.threads as given: A 1, B every core")


def test_an_interrupted_ab_judges_by_the_rounds_that_ran(runs, monkeypatch):
    """--repeats 5 stopped after one round: the verdict was the planned 5 repeats' ("B is 1.22x faster"
    of one process each; a review's finding). It is the rounds every variant finished."""
    from accelrun.report import ab

    seen = []
    real = ab.verdict_line
    monkeypatch.setattr(ab, "verdict_line", lambda row, base, repeats, **kw: seen.append(repeats) or real(row, base, repeats, **kw))
    plan = AbPlan(str(DEFAULT_CONFIG), [Variant("A", []), Variant("B", ["train.seed=0"])], runs["base"].parent, repeats=5)
    summarize_ab(plan, {"A": [runs["base"]], "B": [runs["twin"]]})
    assert seen == [1]

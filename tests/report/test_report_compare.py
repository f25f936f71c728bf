"""compare on short real runs: figures and intervals, loss parity (a changed seed), config and machine
differences, and reading run directories back."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest

from accelrun.report.compare import Group, compare_groups, config_diff
from accelrun.report.compare_render import render_comparison_md, summary_table
from accelrun.report.rundata import RunNotFound, load_run, parse_sources
from tests.report.report_run_helpers import train_tiny


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare") / "runs"
    return {
        "base": train_tiny(root, 8),
        "twin": train_tiny(root, 8),
        "seed1": train_tiny(root, 8, "train.seed=1"),
    }


def groups(*paths):
    return [Group(label, [load_run(p, label=label)]) for label, p in zip("ABCD", paths, strict=False)]


def test_same_recipe_same_seed_is_identical_and_figures_are_filled(runs):
    c = compare_groups(groups(runs["base"], runs["twin"]), resamples=500)
    a, b = c.rows
    assert b.parity.status == "identical" and c.losses_agree
    assert a.steady_steps == b.steady_steps == 7  # 8 steps, 1 warm-up (tiny recipe)
    assert a.median_step_s > 0 and a.tokens_per_s == pytest.approx(128 / a.median_step_s)
    ci = b.speedup
    assert ci.low <= ci.ratio <= ci.high and ci.runs == (1, 1)
    assert c.diff == [] and c.warnings == []
    headers, rows = summary_table(c)
    assert rows[0][headers.index("speed vs A (95% CI)")] == "baseline"
    assert "×" in rows[1][headers.index("speed vs A (95% CI)")]
    # losses in a column line up (trailing zeros kept); parity says against what (found by a new user)
    assert all(len(row[headers.index("final loss")].replace(".", "")) == 4 for row in rows), rows
    from accelrun.report.compare_render import parity_lines

    assert parity_lines(c) == ["B against A: identical over 8 steps"]


def test_changed_seed_is_detected_with_the_step_and_the_cause(runs):
    c = compare_groups(groups(runs["base"], runs["seed1"]), resamples=500)
    p = c.rows[1].parity
    # Same first batch size and init scale: step 1 may still agree within 1e-3; the curves part right after.
    assert not c.losses_agree and p.status == "differ" and p.first_step <= 2 and p.values[0] != p.values[1]
    assert c.rows[1].parity_cause == "expected: train.seed differs"
    (d,) = [d for d in c.diff if d.key == "train.seed"]
    assert d.values == [0, 1] and d.sources[1] == "override 'train.seed=1'"
    md = render_comparison_md(c, title="t")
    assert f"B parts from A at step {p.first_step}" in md and "train.seed" in md
    assert "B: B parts" not in md  # the line names each run once (a new user's trial)


def test_a_run_that_drew_dropout_masks_in_kernels_names_that_as_the_cause(runs, tmp_path):
    """The seed-1 run standing in for one whose report says its graphs drew dropout's numbers with
    accelrun's generator (the other run's from ATen's): the parity cause says so beside the seed."""
    drew = tmp_path / "drew-masks"
    shutil.copytree(runs["seed1"], drew)
    report = json.loads((drew / "report.json").read_text())
    report["compiler"] = {**(report.get("compiler") or {}), "dropout_in_kernels": 2}
    (drew / "report.json").write_text(json.dumps(report))
    c = compare_groups(groups(runs["base"], drew), resamples=200)
    assert c.rows[1].parity_cause == ("expected: train.seed differs; expected: B drew its dropout masks in "
                                      "accelrun's kernels, the other with ATen's")
    c = compare_groups(groups(runs["base"], runs["seed1"]), resamples=200)
    assert "dropout" not in c.rows[1].parity_cause


def test_losses_that_agree_while_one_run_drew_its_masks_in_kernels_say_it_is_not_rounding(runs, tmp_path):
    """A new user's dropout model: "agree within 0.001" read as parity, where the two runs' masks differed
    (true parity was 1.6e-7); the cause names the variant (B), not its repeat (B1)."""
    drew = tmp_path / "drew-masks"
    shutil.copytree(runs["twin"], drew)
    report = json.loads((drew / "report.json").read_text())
    report["compiler"] = {**(report.get("compiler") or {}), "dropout_in_kernels": 1}
    (drew / "report.json").write_text(json.dumps(report))
    c = compare_groups([Group("A", [load_run(runs["base"], label="A1")]), Group("B", [load_run(drew, label="B1")])],
                       resamples=200)
    assert c.losses_agree
    assert c.rows[1].parity_cause == ("close, but not by rounding alone: B drew its dropout masks in accelrun's "
                                      "kernels, the other with ATen's")
    from accelrun.report.compare_render import parity_text

    assert parity_text(c.rows[1], "A").endswith("(close, but not by rounding alone: B drew its dropout masks in "
                                                "accelrun's kernels, the other with ATen's)")


def test_machine_and_software_differences_are_flagged(runs, tmp_path):
    other = tmp_path / "other-run"
    shutil.copytree(runs["twin"], other)
    env = json.loads((other / "env.json").read_text())
    env["cpu"]["model"] = "Some Other CPU 9000"
    env["versions"]["torch"] = "0.0.1"
    env["hostname"] = "elsewhere"
    (other / "env.json").write_text(json.dumps(env))
    c = compare_groups(groups(runs["base"], other), resamples=200)
    text = "\n".join(c.warnings)
    assert "different CPU" in text and "Some Other CPU 9000" in text and "not like for like" in text
    assert "different torch" in text
    assert any("different host" in n for n in c.notes)


def test_a_host_malloc_difference_is_a_warning_unless_the_recipes_ask_for_it(runs, tmp_path):
    """`accelrun ab --a train.cpu_malloc=tuned --b train.cpu_malloc=blocks` compares exactly that."""
    import yaml

    other = tmp_path / "other-malloc"
    shutil.copytree(runs["twin"], other)
    env = json.loads((other / "env.json").read_text())
    env["cpu"]["malloc"] = "tuned: M_MMAP_THRESHOLD = 32 MiB"
    (other / "env.json").write_text(json.dumps(env))
    c = compare_groups(groups(runs["base"], other), resamples=200)
    assert any(w.startswith("different host malloc") and "not like for like" in w for w in c.warnings), c.warnings
    config = yaml.safe_load((other / "config.yaml").read_text())
    config["train"]["cpu_malloc"] = "tuned"
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    c = compare_groups(groups(runs["base"], other), resamples=200)
    assert not any("host malloc" in w for w in c.warnings), c.warnings
    assert any(n.startswith("different host malloc, as train.cpu_malloc differs") for n in c.notes), c.notes


def test_config_diff_lists_every_differing_key_with_sources(runs):
    a, b = load_run(runs["base"]), load_run(runs["seed1"])
    rows = {d.key: d for d in config_diff([a, b])}
    assert set(rows) == {"train.seed"}
    assert "recipes/train/cpu-short.yaml:" in rows["train.seed"].sources[0]


def test_a_family_key_is_no_difference_for_a_run_of_a_users_own_model(runs, tmp_path):
    """A run of ``model.custom`` still records the families' keys (model.dim, ...) but never reads them:
    two such runs do not differ by them, and a difference in the custom run's model.dim is no cause of
    a loss difference."""
    import yaml

    def copy(src, name, **model):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        cfg = yaml.safe_load((dst / "config.yaml").read_text())
        cfg["model"].update(model)
        (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
        return load_run(dst)

    family = load_run(runs["base"])
    wide = copy(runs["base"], "wide", dim=512)
    mine = copy(runs["base"], "mine", custom="mymodels:build", dim=999, n_experts=3)
    theirs = copy(runs["base"], "theirs", custom="mymodels:build", dim=64, kwargs={"p": 0.1})
    # {} against {p: 0.1}: the key p says it (a trial read "model.kwargs (absent)" against "{} (default)" as a
    # difference of its own)
    assert [d.key for d in config_diff([mine, theirs])] == ["model.kwargs.p"]
    assert [d.key for d in config_diff([family, mine])] == ["model.custom"]
    (dim,) = [d for d in config_diff([family, wide, mine]) if d.key == "model.dim"]
    assert dim.sources[2] == "(not read: model.custom is set)" and dim.values[:2] == [family.config_flat["model.dim"], 512]
    from accelrun.report.compare import _numeric_cause

    diff = config_diff([family, wide, mine])
    assert _numeric_cause(diff, [0, 2]) == "expected: model.custom differs"
    assert _numeric_cause(diff, [0, 1]) == "expected: model.dim differs"
    from accelrun.report.compare import environment_differences

    # Runs of different models do different work: their speed ratio compares models, and says so.
    assert any("different models (model.kwargs differs)" in w for w in environment_differences([mine, theirs])[0])
    assert any("different models (model.custom differs)" in w for w in environment_differences([family, mine])[0])
    assert not any("different models" in w for w in environment_differences([family, load_run(runs["twin"])])[0])
    assert any("different models (model.dim differs)" in w for w in environment_differences([family, wide])[0])
    # a setting an A/B of one model varies is not another model
    assert not any("different models" in w for w in environment_differences([family, copy(runs["base"], "init",
                                                                                        init_std=0.5)])[0])


def test_load_run_errors_and_folders(runs, tmp_path):
    with pytest.raises(RunNotFound, match="run directory not found"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunNotFound, match="not a run directory"):
        load_run(tmp_path / "empty")
    name_dir = runs["base"].parent
    newest = load_run(name_dir)  # a folder of runs stands for its newest run: the last one trained
    assert newest.path == runs["seed1"]  # (names alone cannot tell runs started in the same second)
    assert load_run(runs["base"]).status == "finished"


def test_parse_sources_survives_values_with_spaces():
    text = ("name         'a  b'        override 'name=a  b'\n"
            "train.steps  3             /x/recipe.yaml:4\n")
    sources = parse_sources(text, {"name": "a  b", "train.steps": 3})
    assert sources == {"name": "override 'name=a  b'", "train.steps": "/x/recipe.yaml:4"}


def test_an_interrupted_run_compares_from_its_metrics(runs, tmp_path):
    cut = tmp_path / "cut"
    shutil.copytree(runs["twin"], cut)
    (cut / "report.json").unlink()
    r = load_run(cut)
    assert r.status == "interrupted" and len(r.steady_step_times()) == 7
    c = compare_groups(groups(runs["base"], cut), resamples=200)
    assert c.rows[1].parity.status == "identical" and c.rows[1].median_step_s is not None
    assert c.warnings == ["B interrupted after 8 step(s), which its figures cover"], c.warnings
    (cut / "crashed.json").write_text(json.dumps({"error": "RuntimeError: out of memory\n  (traceback...)"}))
    c = compare_groups(groups(runs["base"], cut), resamples=200)
    assert c.warnings[0] == "B crashed after 8 step(s), which its figures cover (RuntimeError: out of memory)"


def test_a_resumed_run_compares_over_all_its_folders(runs, tmp_path):
    """A run killed after step 5 and resumed from its step-3 checkpoint: two folders, steps 4 and 5
    recorded twice. compare reads every step once (the resumed folder's where both have one), and each
    folder's first step is its warm-up."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    rows = [json.loads(line) for line in (runs["twin"] / "metrics.jsonl").read_text().splitlines()]
    for folder, kept in ((first, rows[:5]), (resumed, rows[3:])):
        shutil.copytree(runs["twin"], folder)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    (first / "report.json").unlink()
    (first / "metrics.jsonl").write_text(
        "".join(json.dumps({**m, "loss": m["loss"] + (m["step"] > 3)}) + "\n" for m in rows[:5]))  # 4, 5 redone
    (resumed / "lineage.json").write_text(json.dumps({"continues": str(first), "from_step": 3, "segment": 2}))
    r = load_run(resumed)
    assert [m["step"] for m in r.metrics] == list(range(1, 9)) and r.segments == [first, resumed]
    assert len(r.steady_step_times()) == 2 + 4  # steps 2-3 of the first folder, 5-8 of the resumed one
    c = compare_groups(groups(runs["base"], resumed), resamples=200)
    assert c.rows[1].parity.status == "identical" and c.rows[1].parity.steps_compared == 8, c.rows[1].parity
    assert any(n.startswith("B was resumed: its steps are those of its 2 run folders") for n in c.notes), c.notes


def test_a_resumed_runs_mfu_and_memory_cover_all_its_folders(runs, tmp_path):
    """The first folder (stopped, continued: no report) ran at half the speed and a higher memory peak;
    the resumed folder's report measured only its own steps. compare's MFU follows the run's median step
    over both folders (as its tokens/s does), and its peak is the higher one, from the first's rows."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    rows = [json.loads(line) for line in (runs["twin"] / "metrics.jsonl").read_text().splitlines()]
    shutil.copytree(runs["twin"], first)
    shutil.copytree(runs["twin"], resumed)
    report = json.loads((resumed / "report.json").read_text())
    step = report["step_time_s"]["median"]  # every step takes the measured median: a busy machine cannot flip it
    (resumed / "metrics.jsonl").write_text("".join(json.dumps({**m, "step_time_s": step}) + "\n" for m in rows[5:]))
    (first / "report.json").unlink()  # a stopped folder that was continued writes no report: its rows tell
    (first / "metrics.jsonl").write_text("".join(
        json.dumps({**m, "step_time_s": 2 * step, "mem_peak_bytes": report["mem_peak_bytes"] * 3}) + "\n"
        for m in rows[:5]))
    (resumed / "report.json").write_text(json.dumps({**report, "mfu": 0.5}))
    (resumed / "lineage.json").write_text(json.dumps({"continues": str(first), "from_step": 5, "segment": 2}))
    r = load_run(resumed)
    times = r.steady_step_times()
    assert len(times) == 4 + 2  # steps 2-5 of the first folder, 7-8 of the resumed one
    expected = 0.5 * step / statistics.median(times)
    assert expected == pytest.approx(0.25)  # the slow folder (4 of the 6 steady steps) halves the run's MFU
    env = json.loads((first / "env.json").read_text())
    env["cpu"]["torch_threads"] = r.env["cpu"]["torch_threads"] + 1  # the resumed folder ran on fewer threads
    (first / "env.json").write_text(json.dumps(env))
    c = compare_groups(groups(runs["base"], resumed), resamples=200)
    threads = [w for w in c.warnings if "run folders differ in torch threads" in w]
    n = r.env["cpu"]["torch_threads"]
    assert threads == [f"B's 2 run folders differ in torch threads ({n + 1}, {n}): its figures mix them"], c.warnings
    assert c.rows[1].mfu == pytest.approx(expected)
    assert c.rows[1].mem_peak_bytes == report["mem_peak_bytes"] * 3
    assert c.rows[1].tokens_per_s == pytest.approx(128 / statistics.median(times))


def as_two_ranks(src, dst, slowdown: float):
    """``src`` rewritten as the same recipe on 2 data-parallel ranks: half the tokens per rank per step,
    each step ``slowdown`` times as long (what a 2-rank FSDP job of the same global batch records)."""
    import yaml

    shutil.copytree(src, dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["parallel"]["nproc_per_node"] = 2
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [json.loads(line) for line in (dst / "metrics.jsonl").read_text().splitlines()]
    for m in rows:
        m["tokens"], m["step_time_s"] = m["tokens"] // 2, m["step_time_s"] * slowdown
    (dst / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    report = json.loads((dst / "report.json").read_text())
    report.update(world_size=2, tokens_per_step=report["tokens_per_step"] // 2)
    (dst / "report.json").write_text(json.dumps(report))
    return dst


def test_runs_on_different_rank_counts_compare_job_throughput(runs, tmp_path):
    # 1.25x longer steps on 2 ranks for the same global batch: the job is 0.8x as fast, not 0.4x.
    two = as_two_ranks(runs["twin"], tmp_path / "two", 1.25)
    assert load_run(two).job_tokens_per_step == load_run(runs["base"]).job_tokens_per_step == 128
    c = compare_groups(groups(runs["base"], two), resamples=500)
    a, b = c.rows
    assert b.speedup.ratio == pytest.approx(a.median_step_s / b.median_step_s, rel=1e-6)
    assert b.tokens_per_s == pytest.approx(128 / b.median_step_s)
    assert not any("tokens per step" in n for n in c.notes)


def test_curves_that_part_where_their_learning_rates_do_are_no_drift(runs, tmp_path):
    """Two runs of one recipe but for train.steps (the schedule's length): their learning rates part at
    step 25 and their losses, growing apart slowly, at step 28. That is the recipe, not rounding that
    training amplified: "differ", with the learning rates' step and the key that differs."""
    import yaml

    def synthetic(name, steps, lr_from_25):
        dst = tmp_path / name
        shutil.copytree(runs["twin"], dst)
        cfg = yaml.safe_load((dst / "config.yaml").read_text())
        cfg["train"]["steps"] = steps
        (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
        rows = [{"step": s, "loss": 5.0 - 0.05 * s + (0.01 * (s - 27) if lr_from_25 and s > 27 else 0.0),
                 "lr": 1e-3 * (0.9 if lr_from_25 and s >= 25 else 1.0), "step_time_s": 0.1, "tokens": 128}
                for s in range(1, 41)]
        (dst / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
        return load_run(dst)

    long, short = synthetic("long", 200, False), synthetic("short", 40, True)
    c = compare_groups([Group("A", [long]), Group("B", [short])], resamples=200)
    p = c.rows[1].parity
    assert p.status == "differ" and p.first_step == 28, p
    assert c.rows[1].parity_cause == ("their learning rates differ from step 25 on, 0.001 vs 0.0009; "
                                      "expected: train.steps differs")
    same_lr = synthetic("same-lr", 40, False)
    rows = [json.loads(line) for line in (same_lr.path / "metrics.jsonl").read_text().splitlines()]
    (same_lr.path / "metrics.jsonl").write_text("".join(json.dumps({**m, "loss": m["loss"] * (1 + 0.01 * (m["step"] > 27))})
                                                        + "\n" for m in rows))  # fmt: skip
    assert compare_groups([Group("A", [long]), Group("B", [load_run(same_lr.path)])],
                          resamples=200).rows[1].parity.status == "drift"


def test_mfu_is_taken_against_one_peak_for_every_row(runs, tmp_path):
    """A run that probed its CPU's peak beside a busy process measured half the rate, and its own MFU read
    twice as high for the same steps: ab then showed eager at 31% MFU beside accelrun's 16% for a 1.6x
    faster step (2026-12-06, a new user's run). Every row's MFU is now against the highest peak the runs
    measured, so it follows the step times, and the notes say the probes differed."""
    quiet, busy = tmp_path / "quiet", tmp_path / "busy"
    for path, peak, mfu in ((quiet, 0.2, 0.3), (busy, 0.1, 0.6)):
        shutil.copytree(runs["twin"], path)
        report = json.loads((path / "report.json").read_text())
        (path / "report.json").write_text(json.dumps({**report, "mfu": mfu, "peak": {
            "tflops": peak, "source": "measured: float32 64x64 matrix product probe"}}))
    c = compare_groups(groups(quiet, busy), resamples=200)
    a, b = c.rows
    assert a.mfu == pytest.approx(0.3) and b.mfu == pytest.approx(0.3)
    peak = 0.2
    assert any(n.startswith(f"MFU is against the highest peak these runs measured, {peak:.3g} TFLOP/s") for n in c.notes)
    # Runs that measured the same peak get no note.
    assert not any("highest peak" in n for n in compare_groups(groups(runs["base"], runs["twin"]), resamples=200).notes)
    # Peaks that rightly differ (a GPU's datasheet per precision; a declared one) are each run's own.
    for path in (quiet, busy):
        report = json.loads((path / "report.json").read_text())
        report["peak"]["source"] = "datasheet: H100 SXM dense"
        (path / "report.json").write_text(json.dumps(report))
    c = compare_groups(groups(quiet, busy), resamples=200)
    a, b = c.rows
    assert a.mfu == pytest.approx(0.3) and b.mfu == pytest.approx(0.6)
    # and the notes say so: a bf16 run 1.76x faster had read as the lower MFU (a new user's trial)
    assert ("MFU is each run's against its own peak (0.1, 0.2 TFLOP/s: devices or declared peaks differ): compare "
            "step times and tokens/s, not MFU, across them") in c.notes, c.notes
    # the trial's case: measured peaks of two precisions (bf16's probe measures bf16 products)
    for path, precision in ((quiet, "fp32"), (busy, "bf16-mixed")):
        report = json.loads((path / "report.json").read_text())
        report["peak"]["source"] = "measured: float32 64x64 matrix product probe"
        (path / "report.json").write_text(json.dumps(report))
        config = (path / "config.yaml").read_text().replace("precision: fp32", f"precision: {precision}")
        (path / "config.yaml").write_text(config)
    c = compare_groups(groups(quiet, busy), resamples=200)
    assert any(n.startswith("MFU is each run's against its own peak (0.1, 0.2 TFLOP/s: precisions differ)")
               for n in c.notes), c.notes


def test_a_folder_of_several_runs_says_which_it_stood_for(runs):
    # a new user compared two folders; one held 2 runs, and nothing said the newest was read
    from accelrun.cli.compare_cmd import newest_of_folders

    folder = runs["base"].parent  # every run of the fixture: llama-debug/
    records = [load_run(folder), load_run(runs["base"])]
    (note,) = newest_of_folders([folder, runs["base"]], records)
    assert note == (f"{folder} holds 3 runs: compared its newest, {records[0].path.name} (name a run folder to "
                    "compare another)")


def test_a_run_that_trained_beside_a_busy_neighbour_is_named(runs):
    # a new user compared a 1-process run that took 1 of 2 cores beside a busy neighbour with a 2-rank
    # one, and compare said nothing of it (each run's own report had)
    from accelrun.cli.compare_cmd import busy_runs

    quiet, busy = load_run(runs["base"], label="A"), load_run(runs["twin"], label="B")
    busy.report = {**(busy.report or {}), "machine_load": {"others_cpu_share": 0.27, "threads": 1}}
    quiet.report = {**(quiet.report or {}), "machine_load": {"others_cpu_share": 0.01, "threads": 2}}
    assert busy_runs([quiet, busy]) == ["B: other processes used 27% of the machine's CPU while it trained (it ran "
                                        "on 1 thread): its speed figures are slower than on a quiet machine"]


def test_an_interval_over_single_processes_is_not_marked_a_difference():
    """Two runs of one recipe read "1.274× (1.019–1.848) *, a difference the interval sees" (a trial's): an
    interval over one process's steps each cannot see how another process's pace differs."""
    from accelrun.report.compare_render import ratio_text
    from accelrun.report.stats import RatioCI

    ci = RatioCI(1.274, 1.019, 1.848, 0.95, 1000, (1, 1))
    assert ratio_text(ci, processes=1) == "1.274× (1.019–1.848)"
    assert ratio_text(ci, processes=3) == "1.274× (1.019–1.848) *"
    assert ratio_text(RatioCI(1.01, 0.98, 1.04, 0.95, 1000, (3, 3)), processes=3) == "1.010× (0.980–1.040)"

"""``accelrun ab`` end to end: real training processes, eager against inductor, on the tiny recipe.

Inductor compiles each transformer block in the first step of every B process (a few seconds with a
warm cache, ~30-45 s cold on a 2-core CPU), so this is kept to 2 repeats × 4 steps.
"""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.report.rundata import load_run
from tests.conftest import DEFAULT_CONFIG, TINY

# Every form of ab's last line (report/ab.py's verdict_line), with losses that agree.
VERDICT = re.compile(r"^(B is \d+\.\d+× (faster|slower) than A \(95% CI \d+\.\d+–\d+\.\d+\)|"
                     r"B ran \d+\.\d+× (faster|slower) than A in \d repeat\(s\) \(95% CI \d+\.\d+–\d+\.\d+ over their "
                     r"steps\): too few repeats to call a difference; --repeats 3 or more|no significant "
                     r"difference: B at \d+\.\d+× A's speed \(95% CI \d+\.\d+–\d+\.\d+\)(; about \d+ more "
                     r"repeats? could show its [\d.]+% difference, if it holds|: differences under [\d.]+% do not show at "
                     r"this noise; \d+ more repeats? would bring that to about [\d.]+%, a quieter machine lower "
                     r"still)?); losses agree$", re.M)


def test_ab_eager_vs_compiled_end_to_end(tmp_path):
    # B compiles with accelrun's backend running every op as ATen (no code generation): a compiling
    # variant that costs seconds, where Inductor's cold start in each fresh process costs a minute here.
    out = tmp_path / "ab"
    r = CliRunner().invoke(cli, ["ab", str(DEFAULT_CONFIG), *TINY, "report.log_every=2",
                                 "--a", "compile.backend=eager",
                                 "--b", "compile.backend=accelrun", "compile.executors=[aten]",
                                 "--repeats", "2", "--steps", "4", "--warmup-steps", "0", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert VERDICT.search(r.stdout), r.stdout
    # Progress: which variant and repeat, their step lines, elapsed time.
    for needle in ("[1/4] variant A repeat 1/2", "[4/4] variant B repeat 2/2", "B2 │ step", "elapsed"):
        assert needle in r.stderr, needle

    doc = json.loads((out / "ab.json").read_text())
    assert doc["exit_code"] == 0 and doc["losses_agree"] and doc["repeats"] == 2
    a_dirs, b_dirs = (g["runs"] for g in doc["groups"])
    # Fresh processes, interleaved A B A B: run directories are named by start time.
    assert sorted([*a_dirs, *b_dirs], key=lambda p: p.rsplit("/", 1)[1]) == [a_dirs[0], b_dirs[0], a_dirs[1], b_dirs[1]]
    assert len(list((out / "logs").glob("*.log"))) == 4
    for path in b_dirs:
        run = load_run(path)
        assert run.config_flat["compile.backend"] == "accelrun" and run.config_flat["train.steps"] == 4
        assert run.config_flat["checkpoint.enabled"] is False and not (run.path / "checkpoints").exists()
        assert run.metrics[0]["compile"] and len(run.steady_step_times()) == 3  # the compile step is left out
    assert all(len(load_run(p).steady_step_times()) == 4 for p in a_dirs)  # --warmup-steps 0: all steady
    rows = {row["label"]: row for row in doc["rows"]}
    assert rows["B"]["compile_time_s"] > 0 and rows["A"]["compile_time_s"] is None
    assert rows["B"]["parity"]["status"] in ("identical", "agree")
    assert rows["B"]["speedup"]["runs"] == [2, 2]
    md = (out / "ab.md").read_text()
    assert doc["verdicts"][0] in md and "compile.backend" in md
    assert "<svg" in (out / "ab.html").read_text()


def test_ab_a_failing_variant_exits_5_and_keeps_its_log(tmp_path, monkeypatch):
    """A variant that fails where only training finds it (a model factory that raises off the meta
    device, where validate cannot build it)."""
    (tmp_path / "boom_model.py").write_text(
        "def build():\n"
        "    import torch\n"
        "    if torch.get_default_device().type != 'meta':\n"
        "        raise RuntimeError('boom: the factory failed on purpose')\n"
        "    return torch.nn.Linear(2, 2)\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)  # a factory's module is found in the current folder
    out = tmp_path / "ab"
    r = CliRunner().invoke(cli, ["ab", str(DEFAULT_CONFIG), *TINY, "--a", "model.custom=boom_model:build",
                                 "--b", "train.threads=1", "--repeats", "1", "--steps", "3", "--out", str(out)])
    assert r.exit_code == 5, r.output
    assert "variant A, repeat 1: `accelrun train` exited with code 2" in r.output
    assert "boom: the factory failed on purpose" in r.output  # the child's own message, from the tail of its log
    (log,) = (out / "logs").glob("*.log")
    assert "boom: the factory failed on purpose" in log.read_text()


def test_ab_refuses_a_variant_validate_refuses_before_anything_runs(tmp_path, monkeypatch):
    """What validate finds beyond the recipe (data files, a user's model's kwargs) stops ab before its
    first run, exit 2: a new user's variant B with model.kwargs its factory does not take ran after all
    of A1 and then failed (exit 5), and missing data files waited for their variant's turn likewise.
    Read from validate's own output, which a terminal setting must not colour (FORCE_COLOR, as in CI)."""
    monkeypatch.setenv("FORCE_COLOR", "1")
    out = tmp_path / "ab"
    r = CliRunner().invoke(cli, ["ab", str(DEFAULT_CONFIG), *TINY, "model.custom=examples.my_model:build",
                                 "--b", "model.kwargs={dims: 64}", "--repeats", "1", "--steps", "3", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "variant B: model.kwargs = {'dims': 64} do not fit model.custom" in " ".join(r.output.split()), r.output
    r = CliRunner().invoke(cli, ["ab", str(DEFAULT_CONFIG), *TINY, "--a", "data.source=text",
                                 f"data.paths=[{tmp_path}/missing*.txt]", "--b", "data.source=builtin",
                                 "--repeats", "1", "--steps", "3", "--out", str(out)])
    assert r.exit_code == 2 and "variant A:" in r.output and "missing*.txt" in r.output, r.output
    assert not out.exists() or not any(out.rglob("metrics.jsonl"))

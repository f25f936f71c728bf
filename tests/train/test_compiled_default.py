"""The default recipe trains through accelrun's compiler and says what ran compiled; a second run of the
same job, served by the graph cache, says "loaded from cache" and never "nothing was compiled"."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import load_config
from tests.conftest import DEFAULT_CONFIG, TINY


def test_the_default_recipe_compiles_with_accelrun_at_the_best_scope():
    cfg = load_config(DEFAULT_CONFIG, []).config
    assert cfg.compile.backend == "accelrun" and cfg.compile.scope == "auto"


def _train(tmp_path, name):
    # TINY trains eager for the other tests; the last override puts the default backend back.
    args = ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=3", f"report.runs_dir={tmp_path / 'runs'}",
            f"name={name}", "checkpoint.resume=none", "compile.backend=accelrun", "compile.executors=[cpp,aten]"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    run_dir = next((tmp_path / "runs" / name).iterdir())
    return result.output, json.loads((run_dir / "report.json").read_text()), (run_dir / "report.md").read_text()


def test_cold_then_cached_runs_report_what_ran_compiled(tmp_path):
    # As a new process would: Dynamo's sizes seen by other tests in this worker made the blocks' sizes
    # symbols here (their attention then stayed with ATen, and cpu_attention did not fire).
    torch._dynamo.reset()
    out, report, md = _train(tmp_path, "cold")
    compiler = report["compiler"]
    assert compiler["dynamo_graphs"] == 2 and compiler["graphs_loaded"] == 0  # the blocks' graph + the loss head's
    assert compiler["regions_per_executor"]["cpp"] > 0
    assert "(compile.scope = auto: loss" in report["compiled"]
    assert f"compiled: {compiler['compiled']}" in " ".join(out.split())
    assert "data: builtin (python-stdlib); packing concat; " in out and " documents, " in out  # what it trains on
    assert not compiler["warnings"] and "nothing was compiled" not in md
    cold_passes = compiler["passes_fired"]
    assert cold_passes.get("cpu_attention") and cold_passes.get("fuse_linear_cross_entropy"), cold_passes

    # The same job again: every graph comes from the graph cache, and the report says so.
    out, report, md = _train(tmp_path, "cached")
    compiler = report["compiler"]
    assert compiler["dynamo_graphs"] == 0 and compiler["graphs_loaded"] == 2, compiler["graph_cache"]
    assert compiler["graphs_in_use"] == 2 and "loaded from cache" in compiler["compiled"]
    assert "| graphs | 2: 0 compiled in this run, 2 loaded from the graph cache |" in md
    assert "(2 loaded from the graph cache) |" in md  # the frames row
    assert not compiler["warnings"], compiler["warnings"]
    assert "nothing was compiled" not in md and "nothing was compiled" not in out
    assert "loaded from cache" in " ".join(out.split())
    # What the passes did is saved with the graphs and reported as the cold run did (the attention they
    # left to ATen was missing from a cached report while the cold one said it).
    assert compiler["passes_fired"] == cold_passes

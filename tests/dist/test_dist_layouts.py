"""Multi-process layouts (gloo, CPU) against one process: same losses, step for step.

Every job goes through the real launcher: `accelrun train` starts its ranks through torchrun's
elastic agent. Tolerance: fp32, relative 1e-5 per step's loss (sharded reductions sum in a
different order than one process does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from accelrun.config import load_config
from accelrun.report.metrics import read_metrics
from accelrun.train.run import train
from tests.conftest import DEFAULT_CONFIG, REPO

STEPS = 4
LOSS_RTOL = 1e-5


def accelrun_train(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACCELRUN_NO_PEAK_PROBE": "1"}
    return subprocess.run([sys.executable, "-m", "accelrun.cli.main", "train", str(DEFAULT_CONFIG), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def run_dir_of(runs, name):
    (d,) = list((runs / name).iterdir())
    return d


def losses(d):
    return [m["loss"] for m in read_metrics(d / "metrics.jsonl")]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process reference (micro-batch 4 = the global batch)."""
    from tests.conftest import TINY

    runs = tmp_path_factory.mktemp("single")
    overrides = [*TINY, f"train.steps={STEPS}", f"report.runs_dir={runs}", "checkpoint.every=2", "name=one"]
    return losses(train(load_config(DEFAULT_CONFIG, overrides), command="test").run_dir)


LAYOUTS = {
    "fsdp2": ["parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.micro_batch=2"],
    "tp2": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2"],
    "hsdp2x1": ["parallel.nproc_per_node=2", "parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch=2"],
    "fsdp2_tp2": ["parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch=2"],
    "pp2_gpipe": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "pp2_1f1b": ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp2_fsdp2": ["parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.pp=2", "train.micro_batch=2"],
}
WORLD = {"fsdp2_tp2": 4, "pp2_fsdp2": 4}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(layout, single, tiny, tmp_path):
    r = accelrun_train(*tiny(STEPS, "checkpoint.every=2", f"name={layout}"), *LAYOUTS[layout])
    assert r.returncode == 0, r.stderr[-3000:]
    d = run_dir_of(tmp_path / "runs", layout)
    got = losses(d)
    assert got == pytest.approx(single, rel=LOSS_RTOL), (got, single)
    report = json.loads((d / "report.json").read_text())
    world = WORLD.get(layout, 2)
    assert report["world_size"] == world and len(report["mem_peak_bytes_per_rank"]) == world
    assert report["tokens_per_s_job"] == pytest.approx(report["tokens_per_s"] * world)


def test_checkpoint_of_two_ranks_resumes_in_one_and_back(single, tiny, tmp_path):
    r = accelrun_train(*tiny(STEPS, "checkpoint.every=2", "name=two"), *LAYOUTS["fsdp2"])
    assert r.returncode == 0, r.stderr[-3000:]
    two = run_dir_of(tmp_path / "runs", "two")
    # 2 FSDP ranks -> 1 process, from the step-2 checkpoint.
    one = train(load_config(DEFAULT_CONFIG, tiny(STEPS, "name=one-from-two", "checkpoint.every=2",
                                                 f"checkpoint.resume={two / 'checkpoints' / 'step-000002'}")))
    assert one.report["first_step"] == 3
    assert losses(one.run_dir) == pytest.approx(single[2:], rel=LOSS_RTOL)
    # 1 process -> 2 FSDP ranks, from that run's step-... checkpoint written by one process.
    r = accelrun_train(*tiny(STEPS + 2, "checkpoint.every=2", "name=two-from-one",
                             f"checkpoint.resume={one.run_dir}"), *LAYOUTS["fsdp2"])
    assert r.returncode == 0, r.stderr[-3000:]
    back = run_dir_of(tmp_path / "runs", "two-from-one")
    assert [m["step"] for m in read_metrics(back / "metrics.jsonl")] == [STEPS + 1, STEPS + 2]


def test_unsupported_layout_fails_before_launch(tiny):
    r = accelrun_train(*tiny(2), "parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2",
                       "parallel.pp_schedule=interleaved_1f1b")
    assert r.returncode == 2 and "makes 4 stages, more than model.n_layers = 2" in r.stderr
    assert "launching" not in r.stderr


def test_user_error_in_a_rank_exits_2(tiny, tmp_path):
    r = accelrun_train(*tiny(2, "data.source=text", f"data.paths=[{tmp_path}/none*.txt]"), *LAYOUTS["fsdp2"])
    assert r.returncode == 2 and "none*.txt" in r.stderr

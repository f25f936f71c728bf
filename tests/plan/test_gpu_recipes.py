"""The GPU recipes a user starts from validate, plan as fitting with a plausible MFU on the cluster
they name, and dry-run (their real layout built on meta tensors) to the bytes the planner expects."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.plan import load_plan_config, predict
from tests.conftest import REPO

RECIPES = {  # recipe -> the MFU range an H100 FSDP/TP job of this kind reaches
    "llama3-8b-h100.yaml": (0.30, 0.60),
    "llama3-70b-h100.yaml": (0.25, 0.55),
}
# Every GPU recipe names the machines it ran on, so `accelrun plan RECIPE` needs no --cluster.
CLUSTERS = {"llama3-8b-h100.yaml": ("h100-sxm", 1), "llama3-70b-h100.yaml": ("h100-sxm", 4),
            "llama3-405b-meta.yaml": ("h100-sxm", 2048), "llama3-405b-torchtitan.yaml": ("custom", 64)}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gpu_recipe_validates_and_fits(recipe):
    low, high = RECIPES[recipe]
    plan = predict(load_plan_config(REPO / "configs" / recipe).resolved.config)
    assert plan.fits, plan.verdict
    assert low < plan.mfu < high, plan.mfu
    assert plan.memory.total < 0.8 * plan.memory.capacity  # room for the allocator's fragmentation


@pytest.mark.parametrize("recipe", list(CLUSTERS))
def test_a_gpu_recipe_plans_on_its_own_cluster(recipe):
    r = CliRunner().invoke(cli, ["plan", str(REPO / "configs" / recipe)])
    device, nodes = CLUSTERS[recipe]
    assert r.exit_code == 0 and r.output.splitlines()[0].endswith(f" on {nodes} × 8 {device}"), r.output


def test_another_cluster_keeps_the_recipe_s_node_count():
    """--cluster swaps the hardware a recipe names; the node count the recipe set is the job's and stays."""
    r = CliRunner().invoke(cli, ["plan", str(REPO / "configs" / "llama3-70b-h100.yaml"), "--cluster",
                                 "h100-96gb-grand-teton"])
    assert r.exit_code == 0 and r.output.splitlines()[0].endswith(" on 4 × 8 custom"), r.output


def test_a_job_smaller_than_its_cluster_is_said():
    r = CliRunner().invoke(cli, ["plan", "model/llama3-70b", "--cluster", "h100-8x", "cluster.nodes=4",
                                 "train.precision=bf16-mixed"])
    assert r.exit_code == 3, r.output  # 70 B on one of them does not fit
    assert "note: the recipe's job uses 1 of the cluster's 32 devices" in " ".join(r.output.split()), r.output


def test_the_8b_recipe_dry_runs_to_the_planned_bytes():
    r = CliRunner().invoke(cli, ["train", str(REPO / "configs" / "llama3-8b-h100.yaml"), "--dry-run"])
    assert r.exit_code == 0, r.output
    rows = [line.split() for line in r.output.splitlines() if line.split()[:1] in (["0"], ["7"])]
    assert len(rows) == 2 and all(row[-1] == "1.000" and row[6:8] == ["3.74", "GiB"] for row in rows), r.output  # rank pp rep shard cp tp

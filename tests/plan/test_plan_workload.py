"""The planner's torch-free shape arithmetic equals accelrun.models', and the planner needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from accelrun.config import load_config
from accelrun.errors import UserError
from accelrun.models.flops import flops_per_token, param_count
from accelrun.models.llama import LlamaArgs
from accelrun.plan import PlanOptions
from accelrun.plan import efficiency as eff
from accelrun.plan.comm import MESH_ORDER
from accelrun.plan.pipeline import STAGES_PER_RANK
from accelrun.plan.probes import ATTENTION_BACKWARD_RATIO
from accelrun.plan.workload import Shape, workload_from_config
from tests.conftest import DEFAULT_CONFIG, REPO

MODEL_RECIPES = sorted(p.stem for p in (REPO / "recipes" / "model").glob("*.yaml"))


@pytest.mark.parametrize("name", MODEL_RECIPES)
def test_shape_counts_match_accelrun_models(name):
    m = load_config(f"model/{name}").config.model
    shape = Shape(m.dim, m.n_layers, m.n_heads, m.kv_heads, m.ffn_dim, m.vocab_size, m.tie_embeddings)
    args = LlamaArgs.from_config(m)
    assert shape.param_count() == param_count(args)
    assert shape.param_count(embeddings=False) == param_count(args, embeddings=False)
    for seq in (256, 8192):
        assert shape.model_flops_per_token(seq) == flops_per_token(args, seq)


def test_calibration_counts_attention_as_the_planner_does():
    assert ATTENTION_BACKWARD_RATIO == eff.ATTENTION_BACKWARD_RATIO


def test_layout_conventions_match_accelrun_dist():
    mesh = pytest.importorskip("accelrun.dist.mesh")
    assert [d for d in MESH_ORDER if d in mesh.MESH_DIMS] == list(mesh.MESH_DIMS)
    pipeline = pytest.importorskip("accelrun.dist.pipeline")
    assert pipeline.STAGES_PER_RANK == STAGES_PER_RANK


def test_planning_imports_no_torch():
    code = ("import sys, accelrun.plan, accelrun.plan.calibrate, accelrun.plan.probes, accelrun.cli.plan_cmd; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_workload_reads_the_recipe():
    cfg = load_config(DEFAULT_CONFIG, ["parallel.nproc_per_node=2", "parallel.dp_shard=2",
                                       "train.precision=bf16-mixed", "train.global_batch=32"]).config
    w = workload_from_config(cfg)
    assert (w.layout.dp_shard, w.grad_accum, w.mode, w.stream_bytes) == (2, 1, "bf16-params", 2)
    assert w.tokens_per_device_step == 16 * 256
    assert workload_from_config(cfg, PlanOptions(activation_checkpoint="selective")).ac_mode == "selective"


def test_a_custom_model_cannot_be_planned():
    cfg = load_config(DEFAULT_CONFIG, ["model.custom=pkg.mod:make"]).config
    with pytest.raises(UserError, match="built-in Llama family"):
        workload_from_config(cfg)

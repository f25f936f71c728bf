"""The planner's torch-free shape arithmetic equals accelrun.models', and the planner needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from accelrun.config import load_config
from accelrun.errors import UserError
from accelrun.models.families import get_family, plan_shape
from accelrun.models.families.llama.model import LlamaArgs
from accelrun.models.families.llama.shape import flops_per_token, param_count
from accelrun.plan import PlanOptions
from accelrun.plan import efficiency as eff
from accelrun.plan.comm import MESH_ORDER
from accelrun.plan.pipeline import STAGES_PER_RANK
from accelrun.plan.probes import ATTENTION_BACKWARD_RATIO
from accelrun.plan.workload import workload_from_config
from tests.conftest import DEFAULT_CONFIG, REPO

MODEL_RECIPES = sorted(p.stem for p in (REPO / "recipes" / "model").glob("*.yaml"))


@pytest.mark.parametrize("name", MODEL_RECIPES)
def test_shape_counts_match_the_family(name):
    # The planner's shape comes from the family's torch-free shape module; its counts are the spec's.
    m = load_config(f"model/{name}").config.model
    shape, spec = plan_shape(m), get_family(m.arch)
    args = spec.args_from_config(m)
    assert shape.family == m.arch
    assert shape.param_count() == spec.param_count(args)
    assert shape.param_count(embeddings=False) == spec.param_count(args, embeddings=False)
    for seq in (256, 8192):
        assert shape.model_flops_per_token(seq) == spec.flops_per_token(args, seq)


def test_llama_counts_are_the_planners_shape_plus_the_qkv_biases_it_leaves_out():
    m = load_config("model/llama3-8b").config.model
    shape, args = plan_shape(m), LlamaArgs.from_config(m)
    assert (shape.param_count(), shape.model_flops_per_token(8192)) == (param_count(args), flops_per_token(args, 8192))
    qwen = LlamaArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64, qkv_bias=True)
    biases = 3 * (4 + 2 * 2) * 16  # layers × (query + key + value heads) × head_dim
    assert param_count(qwen) == plan_shape(qwen).param_count() + biases
    assert flops_per_token(qwen, 32) == plan_shape(qwen).model_flops_per_token(32) + 6 * biases


def test_gemma_attention_width_is_heads_times_head_dim():
    # Gemma 7B: 16 heads of 256 in a 3072-wide model; the q and o matrices are 3072 x 4096.
    shape = plan_shape(load_config("model/gemma-7b").config.model)
    gemms = {g.name: (g.in_dim, g.out_dim) for g in shape.block_gemms()}
    assert (shape.head_dim, shape.q_dim, gemms["wq"], gemms["wo"]) == (256, 4096, (3072, 4096), (4096, 3072))
    assert shape.output_params == 0  # tied


def test_calibration_counts_attention_as_the_planner_does():
    assert ATTENTION_BACKWARD_RATIO == eff.ATTENTION_BACKWARD_RATIO


def test_layout_conventions_match_accelrun_dist():
    mesh = pytest.importorskip("accelrun.dist.mesh")
    assert [d for d in MESH_ORDER if d in mesh.MESH_DIMS] == list(mesh.MESH_DIMS)
    pipeline = pytest.importorskip("accelrun.dist.pipeline")
    assert set(pipeline.SCHEDULES) == set(STAGES_PER_RANK)  # each schedule's stages per rank: ParallelConfig


def test_planning_imports_no_torch():
    # Planning a recipe asks its family's shape module, which must not import torch either.
    code = ("import sys, accelrun.plan, accelrun.plan.calibrate, accelrun.plan.probes, accelrun.cli.plan_cmd; "
            "from accelrun.config import load_config; from accelrun.plan.workload import workload_from_config; "
            "[workload_from_config(load_config(c).config) for c in ('configs/llama.yaml', 'configs/gemma.yaml')]; "
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
    with pytest.raises(UserError, match="built-in model families"):
        workload_from_config(cfg)

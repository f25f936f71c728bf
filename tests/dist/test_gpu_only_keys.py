"""train.float8 and parallel.async_tp: refused on a CPU with one line per key (exit 2, before a run directory
exists), refused without what they need anywhere; and what the CPU can check of the CUDA path: which
linear layers become float8 (torchao's own Float8Linear, which constructs on a CPU), that the async-TP
switches are set, that the planner names both as not modelled. The GPU run itself is
bench/gpu_smoke.sh's float8 check."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.config.gpu_only import gpu_only_problems
from accelrun.dist.float8 import converts_to_float8
from accelrun.models.families.llama.model import Llama, LlamaArgs
from accelrun.plan.coverage import unmodelled
from tests.conftest import DEFAULT_CONFIG, TINY

BLOCK_LINEARS = {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}


def run(command: str, *overrides: str):
    return CliRunner().invoke(cli, [command, str(DEFAULT_CONFIG), *TINY, *overrides])


@pytest.mark.parametrize("command", ["train", "validate"])
def test_float8_on_a_cpu_exits_2_naming_the_key_and_what_to_set(command, tmp_path):
    r = run(command, "train.float8=true", f"report.runs_dir={tmp_path}")
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if "train.float8" in line]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: train.float8 = true (override 'train.float8=true'"), lines[0]
    assert "H100 or newer" in lines[0] and "train.device = cpu" in lines[0]
    assert lines[0].endswith("set train.float8: false")
    assert "Traceback" not in r.output and not any(tmp_path.iterdir())


def test_async_tp_says_what_it_needs(tmp_path):
    r = run("train", "parallel.async_tp=true", f"report.runs_dir={tmp_path}")  # tp 1, eager, on the CPU
    assert r.exit_code == 2, r.output
    problems = [line for line in r.stderr.splitlines() if "parallel.async_tp" in line]
    assert len(problems) == 1, r.stderr  # one line, naming all three things it lacks
    assert "needs parallel.tp of 2 or more (here 1)" in problems[0]
    assert "compile.backend: inductor, whose micro-pipeline pass it is (here eager)" in problems[0]
    assert "symmetric memory" in problems[0] and problems[0].endswith("set parallel.async_tp: false")
    cfg = load_config(DEFAULT_CONFIG, [*TINY, "parallel.async_tp=true", "compile.backend=inductor"])
    on_gpu = gpu_only_problems(cfg.config, cfg.sources, on_cuda=True)
    assert len(on_gpu) == 1 and "(here 1); set parallel.async_tp: false, or what it needs" in on_gpu[0], on_gpu


def test_async_tp_with_tp_and_inductor_on_cuda_passes_the_checks():
    cfg = load_config(DEFAULT_CONFIG, [*TINY, "parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.tp=2",
                                       "parallel.async_tp=true", "compile.backend=inductor", "train.float8=true",
                                       "train.device=cuda", "train.micro_batch=2"])
    assert gpu_only_problems(cfg.config, cfg.sources, on_cuda=True) == []
    assert len(gpu_only_problems(cfg.config, cfg.sources, on_cuda=False)) == 2  # float8 and async TP


def test_float8_converts_the_blocks_linears_but_not_the_head_or_unaligned_layers():
    with torch.device("meta"):
        model = Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320))
    chosen = {name for name, m in model.named_modules() if isinstance(m, nn.Linear) and converts_to_float8(m, name)}
    assert chosen == {f"layers.{i}.{part}.{w}" for i in range(2) for part, ws in
                      (("attention", ("wq", "wk", "wv", "wo")), ("feed_forward", ("w1", "w2", "w3"))) for w in ws}
    assert not converts_to_float8(model.output, "output")
    assert not converts_to_float8(nn.Linear(64, 100), "layers.0.feed_forward.w1")  # 100: not a multiple of 16
    assert converts_to_float8(model.layers, "layers")  # containers: torchao descends through them


def test_torchao_swaps_exactly_the_chosen_layers():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from accelrun.dist.float8 import convert_to_float8

    with torch.device("meta"):  # as training builds it: on meta, converted before it is materialised
        model = Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320))
    chosen = convert_to_float8(model)
    swapped = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(chosen) and len(swapped) == 2 * len(BLOCK_LINEARS)
    assert type(model.output) is nn.Linear
    model.to_empty(device="cpu")
    model.init_weights(seed=0)  # the family's initialisation reaches the converted layers' weights
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_async_tp_turns_on_the_micro_pipeline_pass(monkeypatch):
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from accelrun.dist.async_tp import enable_async_tp

    monkeypatch.setattr(inductor_config, "_micro_pipeline_tp", False)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        enable_async_tp(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))["tp"])
        assert inductor_config._micro_pipeline_tp is True
    finally:
        dist.destroy_process_group()


def test_the_plan_names_float8_and_async_tp_as_not_modelled():
    cfg = load_config(DEFAULT_CONFIG, [*TINY, "train.float8=true", "parallel.async_tp=true"]).config
    notes = unmodelled(cfg)
    assert any(n.startswith("train.float8 = true: float8 is not modelled") for n in notes), notes
    assert any(n.startswith("parallel.async_tp = true:") for n in notes), notes


def test_apply_layout_converts_before_anything_else(tmp_path):
    """Training's own path (what a CUDA rank runs after the checks): the model on meta, the layout applied,
    then materialised; the float8 layers are the ones training then sees."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from accelrun.dist.context import ParallelContext
    from accelrun.dist.layout import apply_layout
    from accelrun.models import build_model

    cfg = load_config(DEFAULT_CONFIG, [*TINY, "train.float8=true"]).config
    model = build_model(cfg.model, "meta", seed=0)
    apply_layout(model, cfg, ParallelContext.single(torch.device("cpu")), tmp_path)
    swapped = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == BLOCK_LINEARS and type(model.output) is nn.Linear

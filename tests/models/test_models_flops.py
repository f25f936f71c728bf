"""Parameter counts of the named sizes (recipes/model/*.yaml) and the FLOP convention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from accelrun.config.schema import ModelConfig
from accelrun.models import Llama, LlamaArgs, build_model
from accelrun.models.families.llama.shape import flops_per_token, param_count

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "model"

# Published totals (Meta's Llama 3.1 / 3.2 model cards) as (low, high) bounds in parameters.
PUBLISHED = {
    "llama3-1b": (1.235e9, 1.245e9),  # 1.24B
    "llama3-3b": (3.205e9, 3.215e9),  # 3.21B
    "llama3-8b": (8.025e9, 8.035e9),  # 8.03B
    "llama3-70b": (70.5e9, 70.6e9),  # 70.55B
    "llama3-405b": (405.8e9, 405.9e9),  # 405.85B
}


def load_recipe(name: str) -> ModelConfig:
    data = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
    assert set(data) == {"model"}, f"{name}.yaml must hold only a `model:` section"
    return ModelConfig(**data["model"])


def built_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def test_every_llama_recipe_is_covered():
    # Other families' recipes are checked by their own tests (tests/models/test_gemma.py, ...).
    names = {p.stem for p in RECIPES.glob("*.yaml")
             if yaml.safe_load(p.read_text())["model"].get("arch", "llama") == "llama"}
    assert names == set(PUBLISHED) | {"debug"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    cfg = load_recipe(name)
    n = param_count(LlamaArgs.from_config(cfg))
    low, high = PUBLISHED[name]
    assert low < n < high, f"{name}: {n:,}"


def test_8b_and_70b_to_published_precision():
    assert round(param_count(LlamaArgs.from_config(load_recipe("llama3-8b"))) / 1e7) / 100 == 8.03
    assert round(param_count(LlamaArgs.from_config(load_recipe("llama3-70b"))) / 1e8) / 10 == 70.6


@pytest.mark.parametrize("name", sorted(PUBLISHED) + ["debug"])
def test_analytic_count_equals_built_model_on_meta(name):
    cfg = load_recipe(name)
    model = build_model(cfg)  # meta: no memory
    assert all(p.is_meta for p in model.parameters())
    args = LlamaArgs.from_config(cfg)
    assert built_numel(model) == param_count(args)
    vocab_sized = {model.tok_embeddings.weight, model.output.weight}
    non_embedding = sum(p.numel() for p in model.parameters() if all(p is not v for v in vocab_sized))
    assert non_embedding == param_count(args, embeddings=False)


@pytest.mark.parametrize("tie", [False, True])
def test_analytic_count_equals_materialised_model(tie):
    args = LlamaArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=128, vocab_size=128, tie_embeddings=tie
    )
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")  # must not untie the output layer from the embedding
    assert built_numel(model) == param_count(args)


def test_debug_recipe_is_cpu_sized():
    cfg = load_recipe("debug")
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= 256 + 4
    assert cfg.ffn_dim % 64 == 0
    assert param_count(LlamaArgs.from_config(cfg)) < 5_000_000


def test_training_flops_follow_the_stated_convention():
    args = LlamaArgs.from_config(load_recipe("llama3-8b"))
    n_dense = param_count(args, embeddings=False) + args.vocab_size * args.dim
    for seq_len in (1, 2048, 8192):
        expected = 6 * n_dense + 6 * 2 * args.n_layers * seq_len * args.dim
        assert flops_per_token(args, seq_len) == pytest.approx(expected, rel=1e-12)


def test_short_sequences_cost_about_six_flops_per_parameter():
    for name in ("debug", "llama3-1b", "llama3-8b", "llama3-70b"):
        args = LlamaArgs.from_config(load_recipe(name))
        f = flops_per_token(args, 16)
        assert f > 0
        # The output projection is counted even when tied; the embedding lookup never is.
        assert 5.5 * param_count(args, embeddings=False) < f < 6.5 * param_count(args) * 1.2, name


def test_tied_and_untied_cost_the_same():
    untied = LlamaArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=128)
    tied = LlamaArgs(**{**untied.__dict__, "tie_embeddings": True})
    assert flops_per_token(tied, 64) == flops_per_token(untied, 64)
    assert param_count(untied) - param_count(tied) == 128 * 64

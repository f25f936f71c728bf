"""Adding a model family is its folder and one registry line (README, "add a family"): a toy family
defined in ``tests/models/toy_family/`` the way the built-in ones are, registered in ``FAMILIES``,
built through ``build_model`` and trained one step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from accelrun.models import build_model, model_summary, transformer_blocks
from accelrun.models.build import training_loss_fn
from accelrun.models.families import FAMILIES, family_names, get_family


def test_a_toy_family_registered_by_one_line_builds_and_trains(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", "tests.models.toy_family")  # the one registry line
    assert "toy" in family_names() and get_family("toy").name == "toy"
    # The recipe's model section, as much of it as the family reads.
    cfg = SimpleNamespace(arch="toy", custom=None, kwargs={}, dim=16, n_layers=2, vocab_size=32, init_std=0.02)

    model = build_model(cfg, "cpu", seed=0)
    again = build_model(cfg, "cpu", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    assert len(transformer_blocks(model)) == 2  # where the spec says the blocks are
    summary = model_summary(cfg, model, seq_len=8)
    assert summary["arch"] == "toy" and summary["params_total"] == sum(p.numel() for p in model.parameters())
    assert summary["flops_per_token"] == 6.0 * (2 * 4 * 16 * 16 + 32 * 16)

    torch.manual_seed(0)
    tokens_BT = torch.randint(0, 32, (2, 9))
    inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
    loss_fn = training_loss_fn(model)  # the family's own loss head (its forward takes targets)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = loss_fn(inputs_BT, targets_BT)
    before.backward()
    optimizer.step()
    with torch.no_grad():
        after = loss_fn(inputs_BT, targets_BT)
    assert torch.isfinite(before) and after < before


def test_a_recipe_can_name_the_new_family_with_no_schema_change(monkeypatch):
    # model.arch is checked against the registry, so the registry line is all a recipe needs.
    from accelrun.config import ConfigError, load_config
    from tests.conftest import DEFAULT_CONFIG

    with pytest.raises(ConfigError, match="no model family 'toy'; known: llama"):
        load_config(DEFAULT_CONFIG, ["model.arch=toy"])
    monkeypatch.setitem(FAMILIES, "toy", "tests.models.toy_family")
    cfg = load_config(DEFAULT_CONFIG, ["model.arch=toy", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=2",
                                     "model.n_layers=2"]).config
    model = build_model(cfg.model, "cpu", seed=0)
    assert type(model).__name__ == "Toy" and len(transformer_blocks(model)) == 2

"""The automatic pipeline split (accelrun/plan/stage_split.py): balanced stages with the first stage's
embedding and the last stage's output layer + loss counted in blocks, the split both the planner and
the trainer's pipeline make."""

from __future__ import annotations

import math

import pytest

from accelrun.config import load_config
from accelrun.models.families import plan_shape
from accelrun.plan.stage_split import EndCosts, end_costs, layer_ranges, recipe_stage_layers, split_layers
from accelrun.plan.workload import workload_from_config
from tests.conftest import REPO

META = REPO / "configs" / "llama3-405b-meta.yaml"
TORCHTITAN = REPO / "configs" / "llama3-405b-torchtitan.yaml"


def layer_balanced(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """The split accelrun made before ends were counted: the first stages take the remainder."""
    base, extra = divmod(n_layers, n_stages)
    return tuple(base + (s < extra) for s in range(n_stages))


def costs(split: tuple[int, ...], ends: tuple[float, float]) -> list[float]:
    out = [float(n) for n in split]
    out[0] += ends[0]
    out[-1] += ends[1]
    return out


def test_cheap_ends_give_the_layer_balanced_split():
    for n in range(1, 41):
        for s in range(1, n + 1):
            assert split_layers(n, s) == layer_balanced(n, s), (n, s)
            assert split_layers(n, s, EndCosts(0.49, 0.3)) == layer_balanced(n, s), (n, s)


@pytest.mark.parametrize("ends", [(1, 0), (0, 1), (1, 1), (2, 1), (3, 3)])
def test_stages_are_balanced_within_one_layer(ends):
    for n in range(2, 60):
        for s in range(2, min(n, 17) + 1):
            split = split_layers(n, s, EndCosts(*ends))
            assert sum(split) == n and min(split) >= 1 and len(split) == s, (n, s, split)
            c = costs(split, ends)
            # The most loaded stage is as light as any split can make it: the mean, rounded up, unless an
            # end costs more than that on its own (it then keeps a single layer).
            best = max(math.ceil((n + sum(ends)) / s), 1 + max(ends))
            assert max(c) == best, (n, s, split)
            if 1 + max(ends) <= math.ceil((n + sum(ends)) / s) - 1:  # no end heavier than its share
                assert max(c) - min(c) <= 1, (n, s, split)


def test_a_large_vocabulary_moves_layers_off_the_ends():
    cfg = load_config(TORCHTITAN).config
    shape = plan_shape(cfg.model)
    ends = end_costs(shape, cfg.train.seq_len, recompute=True)
    # Llama 3 405B: the 128K-token embedding and output layer are each about 2/3 of a block's parameters.
    assert ends.first == pytest.approx(shape.vocab_size * shape.dim / shape.block_params)
    assert 0.6 < ends.first < 0.7 and 0.6 < ends.last < 0.7 and ends.whole() == (1, 1)
    assert split_layers(126, 16, ends) == (7,) + (8,) * 14 + (7,)  # torchtitan's split for these 16 stages
    assert split_layers(126, 8, ends) == (15,) + (16,) * 6 + (15,)
    # The same blocks with a byte-sized vocabulary: the ends are cheap, the layer-balanced split.
    small = end_costs(shape.__class__(**{**shape.__dict__, "vocab_size": 256}), cfg.train.seq_len)
    assert small.whole() == (0, 0) and split_layers(126, 16, small) == layer_balanced(126, 16)
    # Llama 3 8B's vocabulary is two blocks' worth: two layers off each end.
    eight_b = plan_shape(load_config("model/llama3-8b").config.model)
    ends_8b = end_costs(eight_b, 8192)
    assert ends_8b.whole() == (2, 2) and split_layers(32, 8, ends_8b) == (3, 5, 5, 5, 4, 4, 4, 2)


def test_the_meta_recipe_splits_as_meta_did_without_pp_layers():
    resolved = load_config(META)
    cfg = resolved.config
    assert cfg.parallel.pp_layers is None  # the recipe relies on the automatic split
    split = recipe_stage_layers(cfg)
    # Meta's: 64 stages of 2 layers, the first and the last of 1 (the recipe's hand-written list until now).
    assert split == (1,) + (2,) * 62 + (1,)
    ends = end_costs(plan_shape(cfg.model), cfg.train.seq_len, recompute=True)
    e = (ends.first, ends.last)
    # Its most loaded stage costs less than the layer-balanced split's (two 2-layer ends, 2 + 2/3 blocks each).
    assert max(costs(split, e)) < max(costs(layer_balanced(126, 64), e))
    # The planner plans the split the trainer makes.
    assert workload_from_config(cfg).layout.stage_layers == split
    assert [len(r) for r in layer_ranges(split)] == list(split) and layer_ranges(split)[-1] == range(125, 126)


def test_the_trainer_pipeline_makes_the_planner_split():
    from accelrun.dist.pipeline import stage_layers
    from accelrun.plan.stage_split import recipe_end_costs

    cfg = load_config(TORCHTITAN).config
    split = recipe_stage_layers(cfg)
    assert [len(r) for r in stage_layers(126, 16, None, recipe_end_costs(cfg))] == list(split)
    assert workload_from_config(cfg).layout.stage_layers == split
    # parallel.pp_layers, where given, is the split.
    explicit = [[0], [1, 2], [3]]
    assert stage_layers(4, 3, explicit, EndCosts(5, 5)) == [range(0, 1), range(1, 3), range(3, 4)]


def test_too_few_layers_for_the_stages_is_an_error():
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 stages"):
        split_layers(3, 4)

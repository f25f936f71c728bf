"""parallel.pp_stages_per_rank: several stages per pipeline rank where an interleaved schedule loops them,
one message naming the key (and its file and line) otherwise; the planner's bubble follows the count."""

from __future__ import annotations

import pytest

from accelrun.config import ConfigError, load_config
from accelrun.plan import PlanOptions, load_plan_config, predict
from accelrun.plan.pipeline import bubble_units
from accelrun.plan.workload import workload_from_config
from tests.conftest import DEFAULT_CONFIG, TINY

PIPELINE = [*TINY, "parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2"]


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [*PIPELINE, *overrides])
    (message,) = e.value.messages
    return message


def test_four_stages_per_rank_split_the_layers_into_eight_stages():
    cfg = load_config(DEFAULT_CONFIG, [*PIPELINE, "model.n_layers=8", "parallel.pp_schedule=interleaved_1f1b",
                                       "parallel.pp_stages_per_rank=4"]).config
    assert cfg.parallel.stages_per_rank == 4
    assert workload_from_config(cfg).layout.stage_layers == (1,) * 8


def test_default_is_the_schedules():
    assert load_config(DEFAULT_CONFIG, [*PIPELINE, "model.n_layers=4", "parallel.pp_schedule=zero_bubble"]
                       ).config.parallel.stages_per_rank == 2
    assert load_config(DEFAULT_CONFIG, PIPELINE).config.parallel.stages_per_rank == 1


def test_one_stage_schedules_refuse_more(write):
    recipe = write("pp.yaml", f"extends: {DEFAULT_CONFIG}\nparallel:\n  pp_stages_per_rank: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe, PIPELINE)
    (message,) = e.value.messages
    assert message.startswith("parallel.pp_stages_per_rank = 4 (") and f"{recipe.resolve()}:3" in message
    assert "needs an interleaved schedule (interleaved_1f1b or zero_bubble)" in message
    assert "parallel.pp_schedule = 1f1b" in message


def test_interleaving_needs_two_and_says_so():
    message = _error("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=1")
    assert "parallel.pp_stages_per_rank = 1" in message and "nearest valid value: 2" in message


def test_without_pipelining_it_is_refused():
    message = _error("parallel.pp=1", "parallel.dp_shard=2", "train.micro_batch=2", "parallel.pp_stages_per_rank=2")
    assert "parallel.pp_stages_per_rank = 2" in message and "parallel.pp = 1" in message


def test_more_stages_than_layers_names_both_keys():
    message = _error("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=4")
    assert "parallel.pp_stages_per_rank = 4" in message and "makes 8 stages, more than model.n_layers = 2" in message


def test_pp_layers_must_list_every_stage():
    message = _error("model.n_layers=8", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=4",
                     "parallel.pp_layers=[[0,1,2,3],[4,5,6,7]]")
    assert "lists 2 stages" in message and "makes 8" in message and "parallel.pp_stages_per_rank = 4" in message


def test_bubble_shrinks_with_stages_per_rank():
    assert bubble_units("interleaved_1f1b", 16, 8) == pytest.approx(bubble_units("interleaved_1f1b", 16) / 4)
    base = [*PIPELINE, "model.n_layers=8", "parallel.pp_schedule=interleaved_1f1b"]
    two, four = (predict(load_plan_config(DEFAULT_CONFIG, [*base, f"parallel.pp_stages_per_rank={v}"],
                                          cluster="h100-8x").resolved.config, PlanOptions()) for v in (2, 4))
    assert four.time.parts["pipeline bubble"] < two.time.parts["pipeline bubble"]

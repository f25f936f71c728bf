"""Parallel plans and their recipe keys, without processes: sequence/loss parallel plans, explicit
pipeline stages, and when communication is timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

from accelrun.config import ConfigError, load_config
from accelrun.dist.comm_timing import comm_timer_for
from accelrun.dist.pipeline import stage_layers
from accelrun.dist.tp import BLOCK_PLAN, SP_BLOCK_PLAN, end_plan
from tests.conftest import DEFAULT_CONFIG, TINY

TP2 = ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.tp=2"]
PP2 = ["parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2"]


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [*TINY, *overrides])  # validate, plan and train share this check
    return "\n".join(e.value.messages)


def test_sequence_parallel_plan_shards_norms_and_the_residual_stream():
    whole = SimpleNamespace(tok_embeddings=object(), norm=object(), output=object())
    plain = end_plan(whole, sequence_parallel=False, vocab_parallel_loss=False)
    assert "norm" not in plain and plain["output"].output_layouts == (Replicate(),)
    sp = end_plan(whole, sequence_parallel=True, vocab_parallel_loss=False)
    assert isinstance(sp["norm"], SequenceParallel)
    assert sp["tok_embeddings"].output_layouts == (Shard(1),) and sp["output"].input_layouts == (Shard(1),)
    assert all(isinstance(SP_BLOCK_PLAN[n], SequenceParallel) for n in ("attention_norm", "ffn_norm"))
    assert SP_BLOCK_PLAN["attention.wo"].output_layouts == (Shard(1),)
    assert SP_BLOCK_PLAN["feed_forward.w2"].output_layouts == (Shard(1),)
    assert not any(isinstance(p, SequenceParallel) for p in BLOCK_PLAN.values())
    # Column-wise q/k/v and gate/up either way.
    for plan in (BLOCK_PLAN, SP_BLOCK_PLAN):
        assert all(isinstance(plan[f"attention.w{x}"], ColwiseParallel) for x in "qkv")
        assert all(isinstance(plan[f"feed_forward.w{x}"], ColwiseParallel) for x in "13")


def test_loss_parallel_keeps_logits_sharded_over_the_vocabulary():
    out = end_plan(SimpleNamespace(tok_embeddings=None, norm=object(), output=object()),
                   sequence_parallel=False, vocab_parallel_loss=True)
    assert "tok_embeddings" not in out  # a stage without the embedding
    assert out["output"].output_layouts == (Shard(-1),) and out["output"].use_local_output is False


def test_sequence_and_loss_parallel_keys_are_checked():
    assert "parallel.sequence_parallel = True" in config_error("parallel.sequence_parallel=true")
    assert "needs tensor parallelism" in config_error("parallel.loss_parallel=true")
    assert "train.seq_len = 33" in config_error(*TP2, "parallel.sequence_parallel=true", "train.seq_len=33")
    load_config(DEFAULT_CONFIG, [*TINY, *TP2, "parallel.sequence_parallel=true", "parallel.loss_parallel=true"])
    # With pipelining too (tests/dist/test_dist_pipeline_tp.py trains it).
    load_config(DEFAULT_CONFIG, [*TINY, *PP2, "parallel.nproc_per_node=4", "parallel.tp=2", "compile.backend=eager",
                                 "parallel.sequence_parallel=true", "parallel.loss_parallel=true"])


@pytest.mark.parametrize("value, expected", [
    ("[[0],[2]]", "layer 1 is in no stage: expected each layer once, in order"),
    ("[[1],[0]]", "the layers are out of order: expected each layer once, in order"),
    ("[[0, 1], [1, 2, 3]]", "layer 1 is in more than one stage"),
    ("[[0,1],[]]", "stage 1 has no layers"),
    ("[[0,1]]", "one list of layers per pipeline stage"),
    ("[[0],[1],[2]]", "lists 3 stages; parallel.pp = 2"),
])
def test_pipeline_layer_lists_are_checked(value, expected):
    assert expected in config_error(*PP2, "model.n_layers=3" if value != "[[0],[2]]" else "model.n_layers=2",
                                    f"parallel.pp_layers={value}")


def test_a_sequence_context_parallelism_cannot_split_names_the_divisor_and_the_nearest_lengths():
    # A trial read "not divisible by 2 × parallel.cp = 2" where the divisor was 4.
    said = config_error("parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.cp=2", "train.seq_len=250")
    assert "is not divisible by 4, twice parallel.cp = 2" in said and "train.seq_len=248 or 252" in said, said


def test_pipeline_layer_list_must_cover_the_model():
    assert "lists 2 layers, not model.n_layers = 3" in config_error(*PP2, "model.n_layers=3",
                                                                    "parallel.pp_layers=[[0],[1]]")


def test_stage_layers_balanced_or_explicit():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(3, 2, [[0], [1, 2]]) == [range(0, 1), range(1, 3)]
    assert stage_layers(4, 4, [[0], [1], [2], [3]]) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError):
        stage_layers(4, 2, [[0], [1, 2]])


def test_communication_is_timed_only_for_cpu_ranks_of_a_job():
    assert comm_timer_for(1, torch.device("cpu")) is None
    assert comm_timer_for(2, torch.device("cuda", 0)) is None

"""The dry run builds a job's real layout for its ranks in this process (a fake process group, meta
tensors) and counts what each rank holds; checked here against the model's own parameter count and the
planner's terms, and in test_meta_init against what the ranks of real jobs hold."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

from accelrun.config import load_config
from accelrun.dist.dry_run import dry_run, format_dry_run, planned_params, representative_ranks
from accelrun.models import build_model
from tests.conftest import DEFAULT_CONFIG, TINY


@pytest.fixture(autouse=True)
def _no_process_group_left_by_earlier_tests():
    """A dry run refuses to replace a process group; in-process tests before this module (the overlap
    passes' gloo group, compile explain's) may have left theirs behind, so it is closed here."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _resolved(*overrides: str):
    return load_config(DEFAULT_CONFIG, [*TINY, *overrides])


def _whole(resolved) -> int:
    return sum(p.numel() for p in build_model(resolved.config.model, "meta").parameters())


def test_fsdp_ranks_split_the_model_and_match_the_plan():
    r = _resolved("parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.micro_batch=2")
    rows = dry_run(r)
    assert [x.rank for x in rows] == [0, 1] and not dist.is_initialized()
    assert sum(x.params for x in rows) == _whole(r)
    assert [x.coords["dp_shard"] for x in rows] == [0, 1]
    for x in rows:
        assert x.grad_bytes == x.param_bytes and x.optimizer_bytes == 2 * x.param_bytes
        assert x.params == pytest.approx(planned_params(r, x), rel=0.01)
    assert len(format_dry_run(r, rows)) == 3


def test_tensor_parallel_ranks_replicate_only_the_norms():
    r = _resolved("parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.tp=2", "train.micro_batch=2")
    rows = dry_run(r, range(4))
    m = r.config.model
    norms = (2 * m.n_layers + 1) * m.dim  # replicated over TP, sharded by FSDP
    assert sum(x.params for x in rows) == _whole(r) + norms  # the second TP rank's copy
    assert {tuple(x.coords.values()) for x in rows} == {(0, 0, d, 0, t) for d in (0, 1) for t in (0, 1)}


def test_pipeline_ranks_hold_their_stages():
    r = _resolved("parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2", "parallel.pp_schedule=gpipe",
                  "model.n_layers=3", "parallel.pp_layers=[[0],[1,2]]")
    first, last = dry_run(r)
    assert first.stages == [0] and last.stages == [1]
    assert first.params + last.params == _whole(r)
    m = r.config.model
    block = (_whole(r) - 2 * m.vocab_size * m.dim - m.dim) // 3
    assert first.params == m.vocab_size * m.dim + block


def test_representative_ranks_are_the_ends_of_each_data_parallel_group():
    deg = {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "tp": 2}
    ranks = representative_ranks(deg)
    # Mesh order (pp, dp_replicate, dp_shard, tp): rank = ((pp * 1 + rep) * 4 + shard) * 2 + tp.
    assert ranks == [0, 1, 6, 7, 8, 9, 14, 15]
    assert math.prod(deg.values()) == 16


def test_a_layout_the_trainer_refuses_exits_2(capsys):
    from accelrun.dist.dry_run import main

    code = main([str(DEFAULT_CONFIG), *TINY, "parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2",
                 "parallel.pp_schedule=interleaved_1f1b"])
    assert code == 2 and "more than model.n_layers" in capsys.readouterr().err


def test_the_dry_run_gives_the_plans_memory_verdict_with_the_activations():
    """A trial's 8B without activation checkpointing: every rank's "ratio 1.000", exit 0, no word that
    `accelrun plan` finds it needs 132 GiB of a 96 GiB device."""
    from accelrun.dist.dry_run import plan_verdict

    said = plan_verdict(load_config("configs/llama3-8b-h100.yaml", ["train.activation_checkpoint.mode=none"]))
    assert said is not None and said.startswith("does not fit: needs "), said
    assert plan_verdict(load_config("configs/llama3-8b-h100.yaml")).startswith("fits: ")

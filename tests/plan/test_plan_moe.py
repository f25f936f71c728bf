"""The planner on a mixture of experts: active-parameter FLOPs, every expert in memory, expert
parallelism's all-to-all time and imbalance assumption, and ep among the layouts --search tries."""

from __future__ import annotations

import pytest

from accelrun.config import load_config
from accelrun.plan import load_plan_config, predict
from accelrun.plan.moe import EP_IMBALANCE, MoEShape, all_to_all_s
from accelrun.plan.search import candidate_overrides
from accelrun.plan.workload import workload_from_config
from tests.conftest import DEFAULT_CONFIG, REPO

MOE = REPO / "configs" / "moe.yaml"
EIGHT = ["parallel.nproc_per_node=8", "train.global_batch=64", "train.precision=bf16-mixed"]


def _plan(*overrides: str):
    return predict(load_plan_config(MOE, [*EIGHT, *overrides], cluster="h100-8x").resolved.config)


def test_shape_counts_active_flops_and_every_expert():
    w = workload_from_config(load_config(MOE).config)
    sh = w.shape
    assert isinstance(sh, MoEShape) and sh.ffn_dim == 2 * 256  # k × moe_ffn_dim: what a token multiplies
    wider = workload_from_config(load_config(MOE, ["model.n_experts=16"]).config).shape
    # More experts: more parameters held, the same FLOPs per token but for the router's 8 more columns.
    assert wider.param_count() - sh.param_count() == 4 * (8 * 3 * 192 * 256 + 8 * 192)
    assert wider.model_flops_per_token(256) - sh.model_flops_per_token(256) == 6 * 4 * 8 * 192


def test_expert_parallel_all_to_all_and_imbalance():
    one, two = _plan("parallel.ep=1"), _plan("parallel.ep=8")
    assert "expert parallel (all-to-all, imbalance)" not in one.time.parts
    w = two.workload
    a2a = all_to_all_s(w, two.cluster)
    link = two.cluster.intra
    # Each rank sends 7/8 of its routed rows (tokens × k × dim, the stream's bytes), the busiest
    # receives EP_IMBALANCE × the mean, with a latency per peer.
    sent = 7 / 8 * w.chunk_tokens * 2 * 192 * w.stream_bytes
    assert a2a == pytest.approx(EP_IMBALANCE * sent / (link.bandwidth_gbs * 1e9) + 7 * link.latency_s)
    part = two.time.parts["expert parallel (all-to-all, imbalance)"]
    assert part > 4 * 4 * a2a  # 4 layers × (2 forward + 2 backward) exchanges, plus the imbalance's matmuls
    assert two.time.comm_time["expert parallel"] > 0
    # ep = dp_shard: each rank holds 1 of 8 experts whole, as FSDP's 1/8 shard would: the same bytes.
    assert two.memory.total == pytest.approx(one.memory.total, rel=0.02)
    # ep < dp_shard: experts replicated over dp_shard / ep, more bytes than FSDP's shards.
    assert _plan("parallel.ep=2").memory.total > one.memory.total


def test_search_tries_expert_parallel_degrees_for_moe_only():
    cfg = load_plan_config(MOE, EIGHT, cluster="h100-8x").resolved.config
    from accelrun.plan import resolve_cluster

    cluster = resolve_cluster(cfg.cluster)
    eps = {o.get("parallel.ep") for o in candidate_overrides(cfg, cluster) if o["parallel.dp_shard"] == 8}
    assert eps == {1, 2, 4, 8}
    dense = load_plan_config(DEFAULT_CONFIG, EIGHT, cluster="h100-8x").resolved.config
    assert all("parallel.ep" not in o for o in candidate_overrides(dense, cluster))


def test_dry_run_places_whole_experts_as_the_plan_counts():
    """``train --dry-run``'s ranks (meta tensors, a fake process group) apply expert parallelism as
    train does: with ep = 2 of dp_shard = 4 each rank holds 4 of 8 experts whole, more than FSDP's
    quarter of all 8, and exactly the plan's figure."""
    from accelrun.dist.dry_run import dry_run, planned_params

    four = ["parallel.nproc_per_node=4", "train.global_batch=16"]
    bytes_held = {}
    for ep in (1, 2):
        resolved = load_config(MOE, [*four, f"parallel.ep={ep}"])
        (row,) = dry_run(resolved, [0])
        assert row.param_bytes == pytest.approx(4 * planned_params(resolved, row), rel=1e-3)
        bytes_held[ep] = row.param_bytes
    experts = 4 * 8 * 3 * 192 * 256  # layers × experts × three 192 × 256 matrices
    assert bytes_held[2] - bytes_held[1] == pytest.approx(4 * experts * (1 / 2 - 1 / 4), rel=1e-3)

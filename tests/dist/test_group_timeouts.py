"""parallel.init_timeout_s bounds setup and parallel.timeout_s a step's collectives, on every process group
a rank is in: the DeviceMesh's own groups (FSDP's, TP's) start with the backend's default timeout (gloo 30
min, NCCL 10), which would otherwise be what a hung TP collective waits."""

from __future__ import annotations

from tests.dist.rank_harness import run_ranks


def test_every_group_gets_the_init_timeout_then_the_step_timeout(tmp_path):
    _, ranks = run_ranks(tmp_path, 2, 1, ["parallel.dp_shard=1", "parallel.tp=2", "parallel.init_timeout_s=300",
                                           "checkpoint.enabled=false"], "group_timeouts")
    for rank, r in enumerate(ranks):
        assert r["code"] == 0 and r["exitcode"] == 0, (rank, r)
        assert len(r["setup"]) >= 2, r  # the world's group and the mesh's
        assert set(r["setup"]) == {300.0}, (rank, r["setup"])
        assert set(r["steps"]) == {120.0}, (rank, r["steps"])  # run_ranks: parallel.timeout_s=120

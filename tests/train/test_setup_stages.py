"""Under an interleaved pipeline schedule a rank holds several stages, each compiled by its own
backend: the setup keeps every stage's compile record, and the report's compile figures cover them all.

Built for rank 0 of a 2-rank job in this process, as the dry run does (torch's ``fake`` process group:
collectives return at once), and each stage's forward and backward run here directly (the schedule's
sends and receives would need the other rank)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from accelrun.config import load_config
from accelrun.dist.context import ParallelContext
from accelrun.dist.mesh import build_mesh, dp_coordinates
from accelrun.train.setup import build_setup
from tests.conftest import DEFAULT_CONFIG, TINY


@pytest.fixture
def rank0_of_two():
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():  # left by an earlier in-process test
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    yield
    dist.destroy_process_group()
    torch._dynamo.reset()


def test_every_stage_of_an_interleaved_schedule_keeps_its_compile_record(tmp_path, rank0_of_two):
    resolved = load_config(DEFAULT_CONFIG, [
        *TINY, "model.n_layers=4", "parallel.nproc_per_node=2", "parallel.dp_shard=1", "parallel.pp=2",
        "parallel.pp_schedule=interleaved_1f1b", "compile.backend=accelrun", "compile.scope=block",
        "compile.executors=[aten]", f"compile.cache_dir={tmp_path / 'cache'}",
    ])  # fmt: skip
    cfg = resolved.config
    mesh = build_mesh(cfg.parallel, "cpu", 2)
    dp_rank, dp_size = dp_coordinates(mesh)
    ctx = ParallelContext(0, 2, 0, torch.device("cpu"), mesh, dp_rank, dp_size, tp_size=1, pp_size=2, cp_size=1)
    s = build_setup(resolved, tmp_path / "run", ctx)
    assert s.pipeline is not None and s.pipeline.stage_ids == [0, 2]

    first, third = s.pipeline.modules
    tokens_BT = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len))
    third(first(tokens_BT)).square().mean().backward()

    summary = s.compile_record.summary()
    # One Dynamo graph per stage's backend; only the last stage's record was kept before.
    assert summary["dynamo_graphs"] == 2, summary
    graphs = {g.name.split(".")[0] for g in s.compile_record.graphs}
    assert graphs == {"stage0", "stage2"}, graphs
    # The compile figures are every stage's: passes and regions joined, seconds summed.
    parts = [record for _, record in s.compile_parts]
    merged = s.compile_record
    assert len(merged.passes) == sum(len(r.passes) for r in parts) > 0
    assert sum(merged.stage_seconds.values()) == pytest.approx(sum(sum(r.stage_seconds.values()) for r in parts))
    assert "stage" in s.compiled or "each of 2 stages" in s.compiled, s.compiled

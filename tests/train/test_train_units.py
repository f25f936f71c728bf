"""Pieces of the training package on their own: LR schedule, resume choice, run locks."""

from __future__ import annotations

import pytest
import torch

from accelrun.config.schema import LRScheduleConfig
from accelrun.report.rundir import create_run_dir, hold_run_lock, is_running
from accelrun.train.optim import lr_factor


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_schedule_warms_up_then_decays_to_the_floor_on_the_last_step(name):
    cfg = LRScheduleConfig(name=name, warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg, 20) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[4:-1], factors[5:], strict=True))


def test_constant_schedule():
    cfg = LRScheduleConfig(name="constant", warmup_steps=0)
    assert {lr_factor(s, cfg, 10) for s in range(10)} == {1.0}


def test_run_lock_marks_a_live_run(tmp_path):
    run = create_run_dir(tmp_path, "x")
    assert not is_running(run)
    with hold_run_lock(run):
        assert is_running(run)
    assert not is_running(run)


@pytest.mark.parametrize("impl", ["foreach", "auto"])
def test_optimizer_steps_with_plain_and_sharded_parameters_side_by_side(impl):
    # TP alone shards Qwen2's q/k/v biases (DTensors) but not the norms (plain): both are 1-D, not decayed;
    # one foreach call over both refuses them (it did, at the first step of a 2-rank TP run).
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accelrun.config.schema import OptimizerConfig
    from accelrun.train.optim import build_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = torch.nn.Module()
        model.norm = torch.nn.Parameter(torch.ones(8))
        model.bias = torch.nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0)], src_data_rank=None))
        model.weight = torch.nn.Parameter(distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)], src_data_rank=None))
        opt = build_optimizer(model, OptimizerConfig(impl=impl, weight_decay=0.1), torch.device("cpu"), sharded=True)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.0]
        assert model.norm.detach().lt(1).all() and model.bias.to_local().lt(0).all()
    finally:
        dist.destroy_process_group()

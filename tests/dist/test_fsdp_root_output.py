"""FSDP2 warns when a sharded module returns a view (an in-place op on it would skip the pre-backward
hook). The root's output goes only to accelrun's loss, which changes nothing in place, so for the root
the warning is noise: a user's model ending in a Linear with a bias (its output a view of addmm's) printed
it from every rank. An inner module's output goes to the user's own code: there it still applies."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

VIEW_WARNING = "returned a view tensor"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)  # a bias: addmm, then a view back to (batch, seq, 8)

    def forward(self, x):
        return self.proj(x)


class UsersModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block, self.head = nn.Embedding(16, 8), Block(), nn.Linear(8, 16)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_roots_view_output_is_not_warned_an_inner_modules_is(fake_group):
    from accelrun.config.schema import ParallelConfig
    from accelrun.dist.fsdp import apply_fsdp
    from accelrun.dist.mesh import build_mesh

    model = UsersModel()
    mesh = build_mesh(ParallelConfig(nproc_per_node=2, dp_shard=2), "cpu", 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each warning every time (a run's own filters come before apply_fsdp's)
        apply_fsdp(model, [model.block], mesh, "fp32", reshard_after_forward=True)
        logits = model(torch.randint(0, 16, (2, 4)))
    assert logits._base is not None  # the root did return a view: the case at hand
    said = [str(w.message) for w in caught if VIEW_WARNING in str(w.message)]
    assert said and all(f"({type(model.block).__name__})" in s for s in said), said  # the block's only

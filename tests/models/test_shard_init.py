"""A shard gets exactly its slice of the values the whole parameter gets, whatever the layout: checked
on DTensors of every rank of a fake 2 x 2 mesh (torch's fake process group, in this process), with
uneven rows, column shards, and FSDP x TP's strided rows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from accelrun.models import shard_init

SHAPE = (2 * 1024 + 37, 96)  # several tiles of 682 rows, a remainder, rows not divisible by 4
PLACEMENTS = {
    "fsdp_rows": (Shard(0), Replicate()),
    "tp_columns": (Replicate(), Shard(1)),
    "fsdp_rows_tp_columns": (Shard(0), Shard(1)),
    "fsdp_x_tp_strided_rows": (_StridedShard(0, split_factor=2), Shard(0)),
}


@pytest.fixture(scope="module")
def whole():
    t = torch.empty(SHAPE)
    shard_init.normal_(t, 0.02, "7/layers.0.attention.wq.weight")
    return t


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_every_rank_gets_its_slice_of_the_whole(name, whole):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    seen = torch.zeros(SHAPE, dtype=torch.int32)
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            placements = PLACEMENTS[name]
            local_shape, offset = compute_local_shape_and_global_offset(SHAPE, mesh, placements)
            p = DTensor.from_local(torch.full(local_shape, float("nan")), mesh, placements, run_check=False,
                                   shape=torch.Size(SHAPE), stride=(SHAPE[1], 1))
            shard_init.normal_(p, 0.02, "7/layers.0.attention.wq.weight")
            region = tuple(slice(o, o + n) for o, n in zip(offset, local_shape, strict=True))
            assert torch.equal(p._local_tensor, whole[region]), (name, rank)
            seen[region] += 1
        finally:
            dist.destroy_process_group()
    # Every element was written, by as many ranks as hold a replica of it.
    replicas = 2 if Replicate() in PLACEMENTS[name] else 1
    assert seen.min() == seen.max() == replicas, (name, seen.unique())


def test_values_depend_on_the_key_and_the_std():
    a, b, c = torch.empty(300, 40), torch.empty(300, 40), torch.empty(300, 40)
    shard_init.normal_(a, 1.0, "1/x.weight")
    shard_init.normal_(b, 1.0, "1/y.weight")
    shard_init.normal_(c, 2.0, "1/x.weight")
    assert not torch.equal(a, b) and torch.equal(2 * a, c)
    assert a.std().item() == pytest.approx(1.0, rel=0.05)

"""The named device mesh: ("pp", "dp_replicate", "dp_shard", "cp", "tp"), sizes from the recipe.

Dimension order puts tensor parallelism innermost, so its ranks are neighbours (one node, the
fastest links), context parallelism next to it, and pipeline stages outermost (they exchange the least).
Context-parallel ranks see the same sequences, so they are not data-parallel ranks for the batch;
but each computes gradients from its own tokens, so FSDP shards and reduces over dp_shard × cp
(:func:`fsdp_mesh`).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from accelrun.config.errors import ConfigError
from accelrun.config.schema import MESH_ORDER, ParallelConfig

MESH_DIMS = MESH_ORDER


def build_mesh(par: ParallelConfig, device_type: str, world_size: int) -> DeviceMesh:
    deg = par.degrees()
    shape = tuple(deg[d] for d in MESH_DIMS)
    if torch.Size(shape).numel() != world_size:
        raise ConfigError(f"parallel degrees {dict(zip(MESH_DIMS, shape, strict=True))} do not multiply to "
                          f"the {world_size} processes that were started")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    if deg["cp"] > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # FSDP's shard dimension (fsdp_mesh)
    return mesh


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: dp_shard (× cp when context parallel), with dp_replicate in front
    for HSDP."""
    shard = "dp_shard_cp" if mesh["cp"].size() > 1 else "dp_shard"
    with warnings.catch_warnings():  # torch asks that flattened dimensions be kept aside; slicing works
        warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
        return mesh["dp_replicate", shard] if mesh["dp_replicate"].size() > 1 else mesh[shard]


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) over replicate × shard, row-major."""
    rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()

"""The named device mesh: ("pp", "dp_replicate", "dp_shard", "tp"), sizes from the recipe.

Dimension order puts tensor parallelism innermost, so its ranks are neighbours (one node, the
fastest links), and pipeline stages outermost (they exchange the least).
"""

from __future__ import annotations

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
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) over replicate × shard, row-major."""
    rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()

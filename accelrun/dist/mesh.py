"""The named device mesh: ("dp_replicate", "dp_shard", "tp"), sizes from the recipe.

Dimension order puts tensor parallelism innermost, so its ranks are neighbours (one node, the
fastest links), and data parallelism outermost.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from accelrun.config.errors import ConfigError
from accelrun.config.schema import ParallelConfig, RunConfig

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def check_supported(cfg: RunConfig) -> None:
    """What this version cannot run yet, said before any process starts."""
    deg = cfg.parallel.degrees()
    if deg["pp"] != 1:
        raise ConfigError(
            f"parallel.pp = {deg['pp']}: pipeline parallelism is not built yet in this version; use pp: 1"
        )
    if deg["tp"] > 1 and cfg.model.custom is not None:
        raise ConfigError(f"parallel.tp = {deg['tp']} needs the built-in Llama; model.custom is set")
    if deg["tp"] > 1 and cfg.model.tie_embeddings:
        raise ConfigError(f"parallel.tp = {deg['tp']} with model.tie_embeddings = true is not supported")


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

"""The named device mesh: ("pp", "dp_replicate", "dp_shard", "tp"), sizes from the recipe.

Dimension order puts tensor parallelism innermost, so its ranks are neighbours (one node, the
fastest links), and pipeline stages outermost (they exchange the least).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from accelrun.config.errors import ConfigError
from accelrun.config.schema import ParallelConfig, RunConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def check_supported(cfg: RunConfig) -> None:
    """What this version cannot run yet, said before any process starts."""
    from accelrun.dist.pipeline import STAGES_PER_RANK

    par = cfg.parallel
    deg = par.degrees()
    if deg["pp"] > 1:
        if cfg.model.custom is not None or cfg.model.tie_embeddings:
            raise ConfigError(f"parallel.pp = {deg['pp']} needs the built-in Llama with untied embeddings "
                              "(model.custom unset, model.tie_embeddings false)")
        stages = deg["pp"] * STAGES_PER_RANK[par.pp_schedule]
        if cfg.model.n_layers < stages:
            raise ConfigError(f"parallel.pp_schedule = {par.pp_schedule} with parallel.pp = {deg['pp']} makes "
                              f"{stages} stages, more than model.n_layers = {cfg.model.n_layers}")
    if deg["tp"] > 1 and cfg.model.custom is not None:
        raise ConfigError(f"parallel.tp = {deg['tp']} needs the built-in Llama; model.custom is set")
    if deg["tp"] > 1 and cfg.model.tie_embeddings:
        raise ConfigError(f"parallel.tp = {deg['tp']} with model.tie_embeddings = true is not supported")
    for key in ("sequence_parallel", "loss_parallel"):
        # Stages exchange the residual stream and the last one computes the loss on plain tensors.
        if getattr(par, key) and deg["pp"] > 1:
            raise ConfigError(f"parallel.{key} = true with parallel.pp = {deg['pp']} is not supported yet")
    if par.loss_parallel and cfg.compile.backend != "eager" and cfg.compile.scope != "block":
        raise ConfigError(f"parallel.loss_parallel = true compiles only with compile.scope = block "
                          f"(compile.scope = {cfg.compile.scope} would compile the sharded loss)")


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

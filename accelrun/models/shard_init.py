"""Initialise a parameter where it lives, shard by shard, with the values one process would give it.

A sharded job builds its model on the meta device, applies its layout (tensor parallelism, FSDP,
pipeline stages), allocates only the local shards (``to_empty``) and then initialises them. For the
job to start from exactly the weights of a one-process run, a parameter's values must not depend on
how it is cut: element ``[i, j]`` of ``layers.3.attention.wq.weight`` must be the same number on
whichever rank holds it.

So draws are made per *tile*: a fixed band of rows of the whole (global) parameter, each tile from
its own generator (on the shard's device) seeded by (run seed, the parameter's name in the whole
model, the tile's index). A rank draws only the tiles that overlap its shard (all of a tile's columns, so a
column shard of tensor parallelism draws ``tp`` times its share; at most two partial tiles per
shard otherwise) and copies its part of each into the local tensor. Peak extra memory: one tile.
The values depend on the device type (CPU and CUDA generators differ), not on the layout.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

TILE_ELEMENTS = 1 << 16  # values per draw: small next to any shard worth sharding, large enough to be cheap


def local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the local tensor, its offset in the global tensor per dim, the global shape)."""
    if isinstance(param, DTensor):
        from accelrun.torch_private import compute_local_shape_and_global_offset

        local = param._local_tensor
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape) != tuple(local.shape):  # a layout this function does not understand: never guess
            raise ValueError(f"shard of shape {tuple(local.shape)} where its placements {param.placements} "
                             f"give {tuple(shape)}")
        return local, tuple(offset), tuple(param.shape)
    return param, (0,) * param.ndim, tuple(param.shape)


def seed_or_draw(seed: int | None) -> int:
    """``seed``, or (None) one drawn from the global RNG."""
    return int(torch.randint(0, 2**62, ())) if seed is None else seed


def param_key(seed: int, module: nn.Module, leaf: str, names: dict[int, str] | None = None) -> str:
    """What a parameter's initial values are drawn from: the run's seed and the parameter's name in
    the whole model (a family's model records each module's as ``_init_name`` when it is built; in a
    block built alone, its name there from ``names``). Every family keys its draws this way, so a
    parameter's values do not depend on how the model is cut."""
    name = getattr(module, "_init_name", None)
    if name is None:
        name = "block." + (names or {}).get(id(module), type(module).__name__)
    return f"{seed}/{name}.{leaf}"


def tile_seed(key: str, tile: int) -> int:
    digest = hashlib.blake2b(f"{key}#{tile}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@torch.no_grad()
def normal_(param: torch.Tensor, std: float, key: str) -> None:
    """Fill ``param`` (plain or DTensor; only its local part is touched) with N(0, std) values that
    depend only on ``key`` and each element's global position."""
    local, offset, shape = local_region(param)
    if local.numel() == 0:
        return
    if not shape:  # a scalar: one tile of one value
        local.copy_(_draw(key, 0, 1, (), std, local.device).reshape(()))
        return
    rows, rest = shape[0], shape[1:]
    width = math.prod(rest)
    per_tile = max(1, TILE_ELEMENTS // max(1, width))
    first, stop = offset[0], offset[0] + local.shape[0]
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    for tile in range(first // per_tile, -(-stop // per_tile)):
        t0 = tile * per_tile
        values = _draw(key, tile, min(per_tile, rows - t0), rest, std, local.device)
        a, b = max(first, t0), min(stop, t0 + values.shape[0])
        local[a - first: b - first].copy_(values[(slice(a - t0, b - t0), *cols)])


def _draw(key: str, tile: int, rows: int, rest: tuple[int, ...], std: float, device: torch.device
          ) -> torch.Tensor:
    # A generator of the shard's own device: an 8B model drawn on one CPU core would take most of a
    # minute, on a GPU well under a second. (So CPU and CUDA runs start from different draws; ranks of
    # one device type agree with one process of that type.)
    generator = torch.Generator(device=device).manual_seed(tile_seed(key, tile))
    return torch.empty((rows, *rest), device=device).normal_(0.0, std, generator=generator)


@torch.no_grad()
def ones_(param: torch.Tensor) -> None:
    local_region(param)[0].fill_(1.0)

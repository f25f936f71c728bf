"""Gradient-norm clipping that works whatever mix of plain and sharded (DTensor) parameters a
parallel layout leaves: tensor parallelism shards matrices but not norm gains, and FSDP × TP puts
them on different meshes, which torch's ``clip_grad_norm_`` cannot stack together."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from accelrun.dist.collective import to_collective_device
from accelrun.log_filters import records_left_out


@torch.no_grad()
def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float, stage_group=None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm`` (inf: only measure); returns
    the norm before scaling as a 0-dim tensor, the same on every rank. ``stage_group``: the pipeline
    group, whose ranks hold different parameters (their squared norms add up).

    Nothing is read on the host: the decision to scale is a tensor too, so on a GPU the step goes on
    to the optimizer without waiting for the norm. A non-finite norm scales nothing (the loop stops
    the run when it reads it)."""
    grads = [p.grad for p in params if p.grad is not None]
    # Group by placement so each group's norms can be computed in one foreach call.
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else None].append(g)
    squares = []
    for group in groups.values():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(group, 2.0)), 2.0)
        if isinstance(norm, DTensor):
            with _one_reduction_per_mesh_dim_quiet():
                norm = norm.full_tensor()  # sums the shards' partial squares across the mesh
        squares.append(norm.float() ** 2)
    # A rank may hold no gradient (a pipeline stage without parameters): it adds zero.
    square = torch.stack(squares).sum() if squares else torch.zeros(())
    if stage_group is not None:
        home = square.device
        square = to_collective_device(square, stage_group)
        torch.distributed.all_reduce(square, group=stage_group)
        square = square.to(home)
    total = square.sqrt()
    if math.isfinite(max_norm) and groups:
        clip = torch.isfinite(total) & (total > max_norm)
        scale = torch.where(clip, max_norm / (total + 1e-6), torch.ones_like(total))
        for group in groups.values():
            torch._foreach_mul_(group, scale)
    return total


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, stage_group=None) -> float:
    """:func:`clip_grad_norm_`, with the norm read on the host."""
    return float(clip_grad_norm_(params, max_norm, stage_group))


def _one_reduction_per_mesh_dim_quiet():
    """Under FSDP x TP the norm is partial on two mesh dimensions, and DTensor reduces it with one
    all-reduce per dimension, warning on every rank's console that one over the flattened mesh would be
    faster. For one scalar a step the second all-reduce is a few microseconds; the warning is left out."""
    return records_left_out("torch.distributed.tensor._redistribute", "sequential")

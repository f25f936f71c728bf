"""The one place that decides which device a collective's tensors live on.

A process group's backend accepts tensors of one kind of device: NCCL takes CUDA tensors only,
gloo CPU tensors. accelrun's own collectives (the loop's per-step agreement, the loss average, the
gradient norm's sum over pipeline stages, the pipeline's loss) carry small *control* tensors, and
each of them is created on, or moved to, ``collective_device(group)`` right before the collective.

Why one helper rather than a ``cpu:gloo,cuda:nccl`` group: a second backend on every group doubles
the process groups each rank sets up (gloo needs TCP connectivity between all nodes, a common
failure on clusters with several network interfaces), and a CPU tensor that slips into a
collective would go over gloo silently instead of failing in every test run. The control tensors
are a few bytes; on a GPU they stay on the GPU with the values they summarise (the loss and the
gradient norm are computed there), so moving them costs nothing.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# Backend name → the device type its collectives take. Read at call time (tests declare another).
BACKEND_DEVICE_TYPE: dict[str, str] = {"nccl": "cuda", "gloo": "cpu", "xccl": "xpu", "mpi": "cpu"}


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device that tensors given to a collective over ``group`` (None: the default group) must be on.

    CUDA devices are the rank's current one (``torch.cuda.set_device`` at rank start-up)."""
    backend = str(dist.get_backend(group))
    # A combined backend ("cpu:gloo,cuda:nccl") takes either; an accelerator keeps control tensors
    # next to the values they summarise.
    names = [part.partition(":")[2] or part for part in backend.split(",")]
    types = [BACKEND_DEVICE_TYPE.get(n, "cpu") for n in names]
    kind = next((t for t in types if t != "cpu"), types[0])
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def to_collective_device(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``t`` on ``collective_device(group)`` (itself when already there)."""
    device = collective_device(group)
    return t if _same_device(t.device, device) else t.to(device)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def set_group_timeouts(timeout: timedelta) -> int:
    """Give every process group this rank is in (the world's, and each DeviceMesh dimension's and any
    flattened dimension's) ``timeout``; returns how many.

    Why: a DeviceMesh creates its groups with the backend's default timeout (NCCL 10 min, gloo 30),
    not the world group's; FSDP's and TP's collectives run on those groups, so without this
    ``parallel.timeout_s`` would bound only the collectives on the world group. Called once the
    groups exist with ``parallel.init_timeout_s`` (setup: building, loading, resuming), and again
    with ``parallel.timeout_s`` before the first step.
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    groups = list(_world.pg_map)
    for group in groups:
        _set_pg_timeout(timeout, group)
    return len(groups)

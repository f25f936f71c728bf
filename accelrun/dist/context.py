"""Who this process is in the job, and its device mesh; one object the training code asks.

A single process gets ``ParallelContext.single()``: rank 0 of 1, no mesh, no collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from accelrun.dist.collective import collective_device, to_collective_device


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None = None
    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    restart_count: int = 0  # how often the elastic agent has restarted this group
    cp_size: int = 1  # context parallelism: ranks that share each sequence (mesh["cp"])

    @classmethod
    def single(cls, device: torch.device) -> ParallelContext:
        return cls(0, 1, 0, device)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar over data-parallel ranks (every rank gets it; TP ranks already agree)."""
        # Context-parallel ranks hold different parts of the loss: they are averaged like dp ranks.
        if not self.distributed or self.dp_size * self.cp_size == 1:
            return value
        # A copy on the group's device (NCCL: this rank's GPU), whatever device the value is on.
        summed = to_collective_device(value.detach(), None).clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # over all ranks: TP replicas count tp times
        return (summed / self.world_size).to(value.device)

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)], device=collective_device(None))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_object(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def env_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the variables torchrun's agent sets; (0, 1, 0) otherwise."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))

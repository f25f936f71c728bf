"""FSDP2 (``fully_shard``): each transformer block and the root sharded over the data-parallel
mesh (dp_shard × cp under context parallelism: cp ranks' gradients are summed like data parallel ones); HSDP (replicate × shard) when dp_replicate > 1; bf16 parameters with fp32 gradient
reduction under ``bf16-mixed``."""

from __future__ import annotations

import re
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from accelrun.dist.expert_parallel import expert_parallel_params
from accelrun.dist.mesh import fsdp_mesh


def apply_fsdp(
    model: nn.Module, blocks, mesh: DeviceMesh, precision: str, reshard_after_forward: bool
) -> None:
    dp_mesh = fsdp_mesh(mesh)  # dp_shard (× cp), HSDP with dp_replicate
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if precision == "bf16-mixed" else MixedPrecisionPolicy())
    for block in blocks or []:  # experts placed by expert parallelism are the ep group's, not FSDP's
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=expert_parallel_params(block) or None)
    # The root is not resharded after forward: backward needs it at once.
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False,
                ignored_params=expert_parallel_params(model) or None)
    # torch warns when a sharded module returns a view, as an in-place op on it would skip the
    # all-gather. The root's output goes only to accelrun's loss, which changes nothing in place: for
    # the root (a model ending in a Linear with a bias) it is noise from every rank. Inner modules' stay.
    warnings.filterwarnings("ignore", re.escape(f"FSDP2-wrapped module ({type(model).__name__}) returned a view"),
                            UserWarning)

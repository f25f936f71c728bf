"""The toy family's spec (imports torch; the folder's ``__init__`` hands it out on first use)."""

from __future__ import annotations

from accelrun.models.families import ModelSpec, TPPlan
from tests.models.toy_family import shape
from tests.models.toy_family.model import Toy, ToyArgs

SPEC = ModelSpec(
    name="toy",
    args_from_config=ToyArgs.from_config,
    build=Toy,
    flops_per_token=shape.flops_per_token,
    param_count=shape.param_count,
    tp_plan=TPPlan(block={}, sequence_parallel_block={}, ends=lambda model, sequence_parallel, loss_parallel: {}),
    blocks_attr="layers",
    first_stage_ends=("embed",),
    last_stage_ends=("norm", "output"),
)

"""The toy family's spec (imports torch; the folder's ``__init__`` hands it out on first use)."""

from __future__ import annotations

from accelrun.models.families import ModelSpec, TPPlan
from tests.models.toy_family import shape
from tests.models.toy_family.model import Toy, ToyArgs

SPEC = ModelSpec.of(
    "toy", Toy, ToyArgs, shape,
    tp_plan=TPPlan(block={}, sequence_parallel_block={}, ends=lambda model, sequence_parallel, loss_parallel: {}),
    first_stage_ends=("embed",),
    last_stage_ends=("norm", "output"),
)

"""The Gemma family's spec (imports torch; ``families.gemma`` hands it out on first use)."""

from __future__ import annotations

from accelrun.models.families import ModelSpec, TPPlan
from accelrun.models.families.gemma import hf, shape
from accelrun.models.families.gemma.model import Gemma, GemmaArgs
from accelrun.models.families.gemma.tp_plan import BLOCK_PLAN, SP_BLOCK_PLAN, end_plan

SPEC = ModelSpec.of(
    "gemma", Gemma, GemmaArgs, shape, hf,
    tp_plan=TPPlan(block=BLOCK_PLAN, sequence_parallel_block=SP_BLOCK_PLAN, ends=end_plan),
    first_stage_ends=("embed_tokens",),
    last_stage_ends=("norm", "lm_head"),
    tied_output_name="lm_head.weight",
)

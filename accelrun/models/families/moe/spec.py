"""The MoE family's spec (imports torch; ``families.moe`` hands it out on first use)."""

from __future__ import annotations

from accelrun.models.families import ModelSpec, TPPlan
from accelrun.models.families.llama.tp_plan import end_plan
from accelrun.models.families.moe import hf, shape
from accelrun.models.families.moe.model import MoE, MoEArgs

_ATTENTION_ONLY = {"attention.wq", "attention.wk", "attention.wv", "attention.wo"}


def _attention_plan() -> dict:
    from accelrun.models.families.llama.tp_plan import BLOCK_PLAN

    return {k: v for k, v in BLOCK_PLAN.items() if k in _ATTENTION_ONLY}


SPEC = ModelSpec.of(
    "moe", MoE, MoEArgs, shape, hf,  # hf: export to Mixtral; reading Mixtral folders is not supported
    tp_plan=TPPlan(block=_attention_plan(), sequence_parallel_block={}, ends=end_plan),
    first_stage_ends=("tok_embeddings",),
    last_stage_ends=("norm", "output"),
    extras={"mfu_basis": "active parameters (top-k routed experts + shared expert + attention + router)"},
)

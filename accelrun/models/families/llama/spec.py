"""The Llama family's spec (imports torch; ``families.llama`` hands it out on first use)."""

from __future__ import annotations

from accelrun.models.families import ModelSpec, TPPlan
from accelrun.models.families.llama import hf, shape
from accelrun.models.families.llama.context_parallel import shard_sequence
from accelrun.models.families.llama.model import Llama, LlamaArgs
from accelrun.models.families.llama.tp_plan import BLOCK_PLAN, SP_BLOCK_PLAN, end_plan

SPEC = ModelSpec.of(
    "llama", Llama, LlamaArgs, shape, hf,
    tp_plan=TPPlan(block=BLOCK_PLAN, sequence_parallel_block=SP_BLOCK_PLAN, ends=end_plan),
    first_stage_ends=("tok_embeddings",),
    last_stage_ends=("norm", "output"),
    shard_sequence=shard_sequence,
)

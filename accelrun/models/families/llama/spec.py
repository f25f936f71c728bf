"""The Llama family's spec (imports torch; ``families.llama`` hands it out on first use)."""

from __future__ import annotations

from accelrun.models.families import ModelSpec, TPPlan
from accelrun.models.families.llama import hf, shape
from accelrun.models.families.llama.context_parallel import shard_sequence
from accelrun.models.families.llama.model import Llama, LlamaArgs
from accelrun.models.families.llama.tp_plan import BLOCK_PLAN, SP_BLOCK_PLAN, end_plan

SPEC = ModelSpec(
    name="llama",
    args_from_config=LlamaArgs.from_config,
    build=Llama,
    flops_per_token=shape.flops_per_token,
    param_count=shape.param_count,
    tp_plan=TPPlan(block=BLOCK_PLAN, sequence_parallel_block=SP_BLOCK_PLAN, ends=end_plan),
    blocks_attr="layers",
    first_stage_ends=("tok_embeddings",),
    last_stage_ends=("norm", "output"),
    tied_output_name="output.weight",
    state_dict_from_hf=hf.state_dict_from_hf,
    state_dict_to_hf=hf.state_dict_to_hf,
    hf_name=hf.hf_name,
    hf_config=hf.hf_config,
    hf_from_tensor=hf.from_hf_tensor,
    hf_row_block=hf.row_block,
    shard_sequence=shard_sequence,
)

"""Gemma's tensor-parallel plan as data. Its blocks use Llama's module names (Llama's attention, a
GeGLU with SwiGLU's w1/w3/w2), so the block plans are Llama's; the ends carry transformers' names."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from accelrun.models.families.llama.tp_plan import BLOCK_PLAN, SP_BLOCK_PLAN

__all__ = ["BLOCK_PLAN", "SP_BLOCK_PLAN", "end_plan"]


def end_plan(model: nn.Module, sequence_parallel: bool, vocab_parallel_loss: bool) -> dict:
    """The plan for the ends this model or stage has: embedding rows split, output columns split."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if vocab_parallel_loss else Replicate(),
            use_local_output=not vocab_parallel_loss,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return {k: v for k, v in plan.items() if getattr(model, k, None) is not None}

"""Llama's tensor-parallel plan (Megatron layout) as data; ``accelrun.dist.tp`` applies it.

Column-wise: q, k, v and the SwiGLU gate/up projections; row-wise: the attention output and down
projections. Under sequence parallelism the norms and the residual stream are sharded along the
sequence (dim 1) and each block's attention and feed-forward gather it first.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}

# Sequence parallel: norms on sequence shards; attention and feed-forward take the gathered
# sequence (as plain tensors: the model code sees ordinary (B, T, D) inputs) and hand back sequence
# shards. The attention's other inputs (the rotary tables) are left alone.
SP_BLOCK_PLAN = {
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                    desired_input_layouts=(Replicate(), None, None), use_local_output=True),
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
}


def ends_plan(embedding: str, output: str) -> Callable[[nn.Module, bool, bool], dict]:
    """The plan for a model's ends (embedding, final norm, output layer), given the embedding's and the
    output layer's attribute names: embedding rows split, output columns split."""

    def end_plan(model: nn.Module, sequence_parallel: bool, vocab_parallel_loss: bool) -> dict:
        stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
        plan = {
            embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
            output: ColwiseParallel(
                input_layouts=stream,
                # Loss parallel keeps the logits a vocabulary-sharded DTensor for loss_parallel().
                output_layouts=Shard(-1) if vocab_parallel_loss else Replicate(),
                use_local_output=not vocab_parallel_loss,
            ),
        }
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        return {k: v for k, v in plan.items() if getattr(model, k, None) is not None}  # a stage may lack an end

    return end_plan


end_plan = ends_plan("tok_embeddings", "output")

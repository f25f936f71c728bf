"""Tensor parallelism for the Llama blocks (Megatron layout), with optional sequence parallelism
and a vocabulary-parallel loss.

Column-wise: q, k, v and the SwiGLU gate/up projections (each rank holds a slice of the heads and
of the hidden width); row-wise: the attention output and down projections (partial sums reduced
into the residual stream). The attention code infers its local head count from the projection
widths, so the model needs no change.

- Plain (``sequence_parallel: false``): the residual stream is replicated on every TP rank; the
  embedding is split by rows and the output layer by columns, both with replicated outputs.
- Sequence parallel: the residual stream and the RMSNorms are sharded along the sequence (dim 1),
  so each rank normalises its own positions and holds 1/tp of the activations between blocks. The
  all-reduce after each row-wise projection becomes a reduce-scatter into sequence shards, and each
  block's attention and feed-forward gather the full sequence first (an all-gather): the same bytes,
  less memory and no repeated norm computation.
- Loss parallel (``loss_parallel: true``): the output layer's logits stay sharded over the vocabulary
  (a DTensor) and the cross-entropy runs under ``torch.distributed.tensor.parallel.loss_parallel``,
  which never gathers the (B, T, V) logits; forward and backward must both run in that context
  (:func:`loss_context`).
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
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


def end_plan(model: nn.Module, sequence_parallel: bool, vocab_parallel_loss: bool) -> dict:
    """The plan for the model's ends (embedding, final norm, output layer) that this stage has."""
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output": ColwiseParallel(
            input_layouts=stream,
            # Loss parallel keeps the logits a vocabulary-sharded DTensor for loss_parallel().
            output_layouts=Shard(-1) if vocab_parallel_loss else Replicate(),
            use_local_output=not vocab_parallel_loss,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return {k: v for k, v in plan.items() if getattr(model, k, None) is not None}  # a stage may lack an end


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> None:
    # The recipe was checked before launch (accelrun.config.validate, parallel problems): a built-in,
    # untied Llama; sequence and loss parallelism without pipeline stages.
    parallelize_module(model, tp_mesh, end_plan(model, sequence_parallel, loss_parallel))
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        parallelize_module(block, tp_mesh, SP_BLOCK_PLAN if sequence_parallel else BLOCK_PLAN)


def loss_context(enabled: bool):
    """The context the loss's forward and backward run in: ``loss_parallel()`` when the logits are
    vocabulary-sharded, else nothing."""
    return loss_parallel() if enabled else contextlib.nullcontext()

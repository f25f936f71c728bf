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
from torch.distributed.tensor.parallel import (
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

# The plans are the model family's data (accelrun.models.families.<family>.tp_plan); re-exported here
# for the callers that name them.
from accelrun.models.families.llama.tp_plan import BLOCK_PLAN, SP_BLOCK_PLAN, end_plan
from accelrun.torch_private import functional_collectives as funcol

__all__ = ["BLOCK_PLAN", "SP_BLOCK_PLAN", "apply_tp", "end_plan", "loss_context"]


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = False, plan=None) -> None:
    """Apply ``plan`` (a family's ``TPPlan``; default: the Llama family's) to the model's ends and blocks."""
    # The recipe was checked before launch (accelrun.config.validate, parallel problems): a built-in
    # model; sequence and loss parallelism without pipeline stages.
    if plan is None:
        from accelrun.models.families import get_family

        plan = get_family("llama").tp_plan
    ends = plan.ends(model, sequence_parallel, loss_parallel)
    parallelize_module(model, tp_mesh, ends)
    for name, style in ends.items():
        if isinstance(style, RowwiseParallel) and style.use_local_output:  # the embedding: it feeds the blocks
            model.get_submodule(name).register_forward_hook(_waited_output)
    # A tied output layer: the embedding and the output layer were each given a sharded copy of the
    # one weight, both split over the vocabulary (rows): share the embedding's again.
    if callable(tie := getattr(model, "tie_weights", None)):
        tie()
    from accelrun.models.build import transformer_blocks  # where the family keeps its blocks

    for block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, plan.sequence_parallel_block if sequence_parallel else plan.block)


def _waited_output(module: nn.Module, args, output):
    """The embedding's reduced output as a plain tensor. It arrives as an AsyncCollectiveTensor (the
    all-reduce not yet waited on), while every later block gets the plain tensor the block before it
    returns: a compiled block then has two input types and Dynamo compiles it twice. The first block
    waits for it at once anyway. ``wait_tensor`` on the wrapper, not its ``wait()``: that returns the
    inner tensor, outside autograd, and the embedding would get no gradient."""
    return funcol.wait_tensor(output) if isinstance(output, funcol.AsyncCollectiveTensor) else output


def loss_context(enabled: bool):
    """The context the loss's forward and backward run in: ``loss_parallel()`` when the logits are
    vocabulary-sharded, else nothing."""
    return loss_parallel() if enabled else contextlib.nullcontext()

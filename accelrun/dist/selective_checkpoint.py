"""Selective (per-op) activation checkpointing: keep what is expensive to recompute, recompute the rest.

A checkpointed block normally keeps only its input and reruns its whole forward in backward. The
selective policy keeps, besides the input, the outputs of the ops that cost the most to rerun and
little to store, as torchtitan's per-op policy does:

- every second matmul of the block (the 1st, 3rd, 5th, ...: in accelrun's Llama wq, wv, w1, w2), so
  backward reruns about half of the block's matmul FLOPs instead of all of them;
- attention (its output and log-sum-exp: quadratic in the sequence to rerun, linear to keep);
- reduce-scatter (sequence parallelism's row-parallel outputs): rerunning it would be a collective in
  backward;
- ``aten.max`` (float8's amax: one number per tensor, rereading the tensor to get it again costs more).

Everything else (norms, rotary embeddings, SwiGLU's pointwise ops, views) is recomputed. The same policy
is what torch.compile sees: Dynamo traces a ``checkpoint`` call with this ``context_fn`` into a tagged
region, AOTAutograd tags each op of it must-save or prefer-recompute, and the partitioner (accelrun's
uses torch's default one, Inductor's the min-cut one) cuts the joint graph along those tags.

``accelrun.plan.activations.selective_saved`` counts the same tensors.

Under accelrun's compiler a checkpointed block reaches the pre-grad passes as one tagged region (a
higher-order op around the block's subgraph), and the passes enter its body
(``compile.pipeline.PassDriver``): RMSNorm, SwiGLU and RoPE fuse there as in an unchecked block, so
backward's rerun runs the fused kernels. Under grouped-query attention the merge of q/k/v into one
matmul changes which matmuls count as every second one: wq+wk+wv, w1 and w2 are kept, wo and w3
rerun (``Shape.block_gemms_merged``; the planner counts the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import accelrun.compile.fused.attention  # noqa: F401  (registers torch.ops.accelrun.cpu_attention)

_aten = torch.ops.aten

MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default})

# Attention kernels, one per backend: their outputs are kept whatever their place in the block.
ATTENTION = frozenset({
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.accelrun.cpu_attention.default,  # the compiler's CPU kernel (compile/fused/attention.py)
    torch.ops.accelrun.cpu_attention_masked.default,  # the same, given a mask it looks at when it runs
})

ALWAYS_SAVED = ATTENTION | {_aten.max.default, torch.ops._c10d_functional.reduce_scatter_tensor.default}


@dataclass
class MatmulCount:
    """Matmuls seen by one checkpointed call, counted apart in its forward and in backward's rerun, so a
    rerun that asks again makes the same choice for the n-th matmul as the forward did (torch 2.13 asks
    only in the forward and replays its answers; earlier versions asked in the rerun too)."""

    forward: int = 0
    recompute: int = 0

    def next(self, is_recompute: bool) -> int:
        if is_recompute:
            self.recompute += 1
            return self.recompute
        self.forward += 1
        return self.forward


@dataclass
class SelectivePolicy:
    """The keep/recompute decision for one checkpointed call of a block (a fresh one per call)."""

    matmuls: MatmulCount = field(default_factory=MatmulCount)

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            # The odd-numbered ones are kept: 1st, 3rd, ... (the count starts at 1).
            keep = self.matmuls.next(ctx.is_recompute) % 2 == 1
        else:
            keep = func in ALWAYS_SAVED
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> tuple:
    """``torch.utils.checkpoint.checkpoint``'s ``context_fn`` for the selective policy."""
    return create_selective_checkpoint_contexts(SelectivePolicy())


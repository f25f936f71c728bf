"""Causal attention of one query chunk over a longer key prefix, without a materialised mask.

Chunk ``j`` of a context-parallel rank (``c`` queries at positions ``j·c ..``) attends to keys
``[0, (j+1)·c)``: all of the first ``j·c`` (no mask needed) and the diagonal ``c × c`` block under a
plain causal mask. Passing SDPA a boolean mask for that instead costs a float copy of it,
``c × (j+1)·c`` numbers, which autograd keeps for backward: per layer more than the whole
attention saves in one process. So the two blocks run as two fused flash-attention calls (no mask,
and ``is_causal``) whose outputs are merged by their log-sum-exps (online softmax):
``lse = log(e^lse₁ + e^lse₂)``, ``o = e^(lse₁−lse)·o₁ + e^(lse₂−lse)·o₂``. The backward runs each
block's flash backward with the merged output and log-sum-exp, which gives every block its exact
share of the gradient (the softmax's normaliser is the merged one).

CPU only (``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp);
other devices use SDPA with a mask (``accelrun.dist.context_parallel``).
"""

from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class PrefixCausalAttention(torch.autograd.Function):
    """``(q (B,H,c,E), k_prefix, v_prefix (B,H,P,E), k_diag, v_diag (B,H,c,E)) -> o (B,H,c,E)``."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_diag, v_diag):
        o, lse = _flash(q, k_diag, v_diag, 0.0, True)
        if k_prefix.shape[2] > 0:
            o_pre, lse_pre = _flash(q, k_prefix, v_prefix, 0.0, False)
            merged = torch.logaddexp(lse_pre, lse)  # (B, H, c), fp32
            o = (o_pre.float() * (lse_pre - merged).exp().unsqueeze(-1)
                 + o.float() * (lse - merged).exp().unsqueeze(-1)).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k_prefix, v_prefix, k_diag, v_diag, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k_prefix, v_prefix, k_diag, v_diag, o, lse = ctx.saved_tensors
        do = do.contiguous()
        dq, dk_diag, dv_diag = _flash_backward(do, q, k_diag, v_diag, o, lse, 0.0, True)
        if k_prefix.shape[2] > 0:
            dq_pre, dk_prefix, dv_prefix = _flash_backward(do, q, k_prefix, v_prefix, o, lse, 0.0, False)
            dq = dq + dq_pre
        else:
            dk_prefix, dv_prefix = torch.zeros_like(k_prefix), torch.zeros_like(v_prefix)
        return dq, dk_prefix, dv_prefix, dk_diag, dv_diag


def prefix_causal_attention(q_BHcE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                            chunk: int) -> torch.Tensor:
    """Queries of chunk ``chunk`` (size ``c``) against keys ``[0, (chunk+1)·c)`` of the whole sequence."""
    c = q_BHcE.shape[2]
    start = chunk * c
    return PrefixCausalAttention.apply(q_BHcE, k_BHTE[:, :, :start], v_BHTE[:, :, :start],
                                       k_BHTE[:, :, start:start + c], v_BHTE[:, :, start:start + c])

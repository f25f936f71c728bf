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


def _repeat_heads(x_BGTE: torch.Tensor, n_heads: int) -> torch.Tensor:
    group = n_heads // x_BGTE.shape[1]
    return x_BGTE.repeat_interleave(group, dim=1) if group > 1 else x_BGTE


def _sum_heads(dx_BHTE: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of ``_repeat_heads``: each key/value head's copies summed."""
    B, H, T, E = dx_BHTE.shape
    return dx_BHTE.view(B, kv_heads, H // kv_heads, T, E).sum(2) if H > kv_heads else dx_BHTE


class PrefixCausalAttention(torch.autograd.Function):
    """``(q (B,H,c,E), k, v (B,G,T,E), start) -> o (B,H,c,E)``: the queries against keys
    ``[0, start)`` (no mask) and ``[start, start + c)`` (causal).

    Keys and values come with their own G heads and are repeated to the H query heads inside, in the
    forward and again in the backward: what is kept for backward is the G-head tensors (the whole
    sequence's, under context parallelism), not H / G times as much. They come whole, not sliced, so
    that the backward writes their gradients into one ``(B,G,T,E)`` tensor each: autograd's backward
    of a slice would allocate (and zero) a whole-sequence gradient per slice."""

    @staticmethod
    def forward(ctx, q, k, v, start):
        H, c = q.shape[1], q.shape[2]
        o, lse = _flash(q, _repeat_heads(k[:, :, start:start + c], H), _repeat_heads(v[:, :, start:start + c], H),
                        0.0, True)
        if start > 0:
            o_pre, lse_pre = _flash(q, _repeat_heads(k[:, :, :start], H), _repeat_heads(v[:, :, :start], H), 0.0, False)
            merged = torch.logaddexp(lse_pre, lse)  # (B, H, c), fp32
            o = (o_pre.float() * (lse_pre - merged).exp().unsqueeze(-1)
                 + o.float() * (lse - merged).exp().unsqueeze(-1)).to(q.dtype)
            lse = merged
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.start = start
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        start, (H, c), G = ctx.start, q.shape[1:3], k.shape[1]
        do = do.contiguous()
        dk_BGTE, dv_BGTE = torch.zeros_like(k), torch.zeros_like(v)
        diag = slice(start, start + c)
        dq, dk, dv = _flash_backward(do, q, _repeat_heads(k[:, :, diag], H), _repeat_heads(v[:, :, diag], H), o, lse,
                                     0.0, True)
        dk_BGTE[:, :, diag], dv_BGTE[:, :, diag] = _sum_heads(dk, G), _sum_heads(dv, G)
        if start > 0:
            dq_pre, dk, dv = _flash_backward(do, q, _repeat_heads(k[:, :, :start], H),
                                             _repeat_heads(v[:, :, :start], H), o, lse, 0.0, False)
            dq = dq + dq_pre
            dk_BGTE[:, :, :start], dv_BGTE[:, :, :start] = _sum_heads(dk, G), _sum_heads(dv, G)
        return dq, dk_BGTE, dv_BGTE, None


def prefix_causal_attention(q_BHcE: torch.Tensor, k_BGTE: torch.Tensor, v_BGTE: torch.Tensor,
                            chunk: int) -> torch.Tensor:
    """Queries of chunk ``chunk`` (size ``c``) against keys ``[0, (chunk+1)·c)`` of the whole sequence
    (G key/value heads, G dividing the H query heads)."""
    return PrefixCausalAttention.apply(q_BHcE, k_BGTE, v_BGTE, chunk * q_BHcE.shape[2])

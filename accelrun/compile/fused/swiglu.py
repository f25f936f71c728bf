"""SwiGLU's gate: ``silu(a) * b``.

Autograd on the unfused graph saves a, sigmoid(a) (inside silu's backward), silu(a) and b; this backward
saves a and b only and recomputes sigmoid(a) (one pointwise op) in a precision at least fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # bf16 -> fp32, fp64 stays fp64


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        dtype = torch.promote_types(_compute_dtype(a), _compute_dtype(b))
        a32, b32, g32 = a.to(dtype), b.to(dtype), grad_out.to(dtype)
        sig = torch.sigmoid(a32)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            # d silu(a) / da = sig * (1 + a * (1 - sig))
            grad_a = (g32 * b32 * sig * (1 + a32 * (1 - sig))).sum_to_size(a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = (g32 * a32 * sig).sum_to_size(b.shape).to(b.dtype)
        return grad_a, grad_b


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b`` with a backward that saves only a and b."""
    return _SwiGLU.apply(a, b)

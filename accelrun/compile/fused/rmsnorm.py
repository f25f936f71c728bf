"""RMSNorm: ``y = x * rsqrt(mean(x^2, -1) + eps)`` [cast back to x's dtype] [* weight].

Autograd on the unfused graph saves x, x^2's mean, rsqrt's output, the normalised x, and the cast; this
backward saves x and the per-row rstd (one value per row) and recomputes the normalised x from them.
"""

from __future__ import annotations

import torch


def _normalize(x: torch.Tensor, rstd: torch.Tensor | None, eps: float, upcast: bool):
    xc = x.float() if upcast else x
    if rstd is None:
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return xc * rstd, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, upcast: bool, cast_back: bool):
        xhat, rstd = _normalize(x, None, eps, upcast)
        y = xhat.to(x.dtype) if cast_back else xhat
        ctx.save_for_backward(x, rstd, weight)
        ctx.upcast, ctx.cast_back, ctx.has_weight = upcast, cast_back, weight is not None
        return y * weight if weight is not None else y

    @staticmethod
    def backward(ctx, grad_out):
        x, rstd, weight = ctx.saved_tensors
        xhat, _ = _normalize(x, rstd, 0.0, ctx.upcast)
        grad_x = grad_weight = None
        grad_y = grad_out
        if ctx.has_weight:
            if ctx.needs_input_grad[1]:
                y = xhat.to(x.dtype) if ctx.cast_back else xhat
                grad_weight = (grad_out * y).sum_to_size(weight.shape).to(weight.dtype)
            grad_y = grad_out * weight
        if ctx.needs_input_grad[0]:
            # d/dx of x * r(x), r = (mean(x^2) + eps)^-1/2:  r * (g - xhat * mean(g * xhat)).
            g = grad_y.sum_to_size(xhat.shape).to(xhat.dtype)
            grad_x = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    upcast: bool = False,
    cast_back: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim. ``upcast``: normalise ``x.float()``; ``cast_back``: cast the normalised
    value to x's dtype before the weight multiplies it (llama.py's ``y.type_as(x) * weight``)."""
    return _RMSNorm.apply(x, weight, eps, upcast, cast_back)

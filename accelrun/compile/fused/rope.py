"""Rotary embeddings in Meta's adjacent-pair layout (llama.py's ``apply_rope``).

Pairs (x[2i], x[2i+1]) are rotated by the position's angle. The backward is the inverse rotation of the
gradient, so it needs only cos and sin (small (T, R) tables), never x; autograd on the unfused graph
saves x's halves, cos and sin at every multiply.
"""

from __future__ import annotations

import torch


def _pairs(t: torch.Tensor):
    return t.unflatten(-1, (-1, 2)).unbind(-1)  # each (..., R)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, upcast: bool, cast_back: bool):
        x0, x1 = _pairs(x.float() if upcast else x)
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        tables_need_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(cos, sin, x if tables_need_grad else None)
        ctx.upcast, ctx.compute_dtype, ctx.x_shape, ctx.x_dtype = upcast, out.dtype, x.shape, x.dtype
        return out.to(x.dtype) if cast_back else out

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin, x = ctx.saved_tensors
        g0, g1 = _pairs(grad_out.to(ctx.compute_dtype))
        grad_x = grad_cos = grad_sin = None
        if ctx.needs_input_grad[0]:
            # The transpose of the rotation [[c, -s], [s, c]] is the rotation by minus the angle.
            grad_x = torch.stack((g0 * cos + g1 * sin, g1 * cos - g0 * sin), dim=-1).flatten(-2)
            grad_x = grad_x.sum_to_size(ctx.x_shape).to(ctx.x_dtype)
        if x is not None:
            x0, x1 = _pairs(x.float() if ctx.upcast else x)
            if ctx.needs_input_grad[1]:
                grad_cos = (g0 * x0 + g1 * x1).sum_to_size(cos.shape).to(cos.dtype)
            if ctx.needs_input_grad[2]:
                grad_sin = (g1 * x0 - g0 * x1).sum_to_size(sin.shape).to(sin.dtype)
        return grad_x, grad_cos, grad_sin, None, None


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, upcast: bool = False, cast_back: bool = False
) -> torch.Tensor:
    """Rotate x's adjacent pairs; cos/sin broadcast against (..., R). ``upcast``: rotate ``x.float()``;
    ``cast_back``: return in x's dtype (llama.py's ``.type_as(x)``)."""
    return _Rope.apply(x, cos, sin, upcast, cast_back)

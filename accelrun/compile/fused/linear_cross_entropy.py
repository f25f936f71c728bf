"""The output projection and the cross-entropy loss, in chunks of rows: the (N, V) logits never exist.

Unfused, the logits (N, V) are materialised, upcast to fp32 and saved by log-softmax for the backward:
with V = 128k and N = 8k that is 4 GiB in fp32. Here the forward walks ``chunk_rows`` rows at a time;
for each chunk it computes the logits, the loss terms, and at once the chunk's gradients (softmax minus
one-hot, through the projection), then drops the logits. The gradients with respect to h, the weight
and the bias are what the backward needs: it only scales them by the incoming gradient (a scalar, since
the reduction is mean or sum). So the FLOPs are those of the unfused forward and backward, and the peak
extra memory is one chunk's logits plus the gradients (the size of h and of the weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunk_grads(z: torch.Tensor, lse: torch.Tensor, onehot: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """d(sum of the chunk's losses)/d logits: softmax(z) - onehot(target), zero on ignored rows.

    The row mask is computed here from the targets rather than shared with the loss: in a compiled
    graph a shared mask joins the loss's region, which reads this one's results, and the product
    with it would then be left outside both (one more pass over the logits)."""
    keep = (target[:, None] != ignore_index).to(z.dtype)
    return (torch.exp(z - lse[:, None]) - onehot.to(z.dtype)) * keep


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, target, ignore_index: int, reduction: str, chunk_rows: int, upcast: bool):
        h_ND = h.reshape(-1, h.shape[-1])
        target_N = target.reshape(-1)
        need_grads = any(ctx.needs_input_grad[:3])
        # Loss arithmetic and gradient sums in fp32 at least (fp64 stays fp64, for gradcheck).
        acc = torch.promote_types(torch.promote_types(h.dtype, weight.dtype), torch.float32)
        total = h_ND.new_zeros((), dtype=acc)
        grad_h_chunks = []
        # Gradient sums start from the first chunk's (no zeros + add: one chunk is the common case).
        grad_weight = grad_bias = None
        want_weight = ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        out_dtype = torch.float32
        classes = torch.arange(weight.shape[0], device=h.device)
        for h_c, t_c in zip(h_ND.split(chunk_rows), target_N.split(chunk_rows), strict=True):
            logits = F.linear(h_c, weight, bias)  # (rows, V), the only chunk-sized tensors live at once
            if not upcast:
                out_dtype = logits.dtype
            z = logits.to(acc)
            lse = torch.logsumexp(z, dim=-1)
            valid = t_c != ignore_index
            # The target's logit and the gradient's -1 through a one-hot comparison rather than
            # gather and scatter: elementwise, so it fuses with the softmax around it (one pass
            # over the logits) where a scatter would copy them first.
            onehot = classes[None, :] == t_c[:, None]
            picked = torch.where(onehot, z, 0.0).sum(1)
            total = total + torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if need_grads:
                grad_z = _chunk_grads(z, lse, onehot, t_c, ignore_index).to(logits.dtype)
                if ctx.needs_input_grad[0]:
                    grad_h_chunks.append(grad_z @ weight)
                if want_weight:
                    # Summed in place: a new sum per chunk held three (V, D) fp32 tensors at once (2 GiB
                    # each at a 128k vocabulary and dim 4,096).
                    if grad_weight is None:
                        grad_weight = (grad_z.t() @ h_c).to(acc)
                    elif grad_z.dtype == acc:
                        grad_weight.addmm_(grad_z.t(), h_c)
                    else:
                        grad_weight.add_(grad_z.t() @ h_c)
                if want_bias:
                    part = grad_z.to(acc).sum(0)
                    grad_bias = part if grad_bias is None else grad_bias + part
        count = (target_N != ignore_index).sum().to(acc)
        # Mean divides by the rows that count (ignore_index excluded), as F.cross_entropy does.
        scale = 1.0 / count if reduction == "mean" else torch.ones_like(count)
        # Every target ignored: the mean is NaN, as F.cross_entropy's, but the gradients are zeros, as
        # its are (0 * inf would make them NaN): chat data can mask a whole micro-batch.
        grad_scale = 1.0 / count.clamp(min=1) if reduction == "mean" else scale
        grad_h = None
        if grad_h_chunks:
            grad_h = (grad_h_chunks[0] if len(grad_h_chunks) == 1 else torch.cat(grad_h_chunks)).reshape(h.shape)
        ctx.save_for_backward(grad_h, grad_weight, grad_bias, grad_scale)
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        return (total * scale).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_weight, grad_bias, scale = ctx.saved_tensors
        factor = grad_loss.to(scale.dtype) * scale
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        out = [None] * 8
        if grad_h is not None:
            out[0] = (grad_h * factor).to(h_dtype)
        if grad_weight is not None:
            out[1] = (grad_weight * factor).to(w_dtype)
        if grad_bias is not None:
            out[2] = (grad_bias * factor).to(b_dtype)
        return tuple(out)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 1024,
    upcast: bool = True,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight, bias).flatten(0, -2)[.float()], target.flatten())`` in chunks.

    ``h``: (..., D), ``weight``: (V, D), ``target``: class indices with h's leading shape (any layout
    that flattens to N = h.numel() / D). ``upcast``: the loss is computed on fp32 logits and returned in
    fp32 (llama.py's ``.float()``); otherwise the loss has the logits' dtype (the arithmetic is fp32).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be positive, got {chunk_rows}")
    return _LinearCrossEntropy.apply(h, weight, bias, target, ignore_index, reduction, chunk_rows, upcast)

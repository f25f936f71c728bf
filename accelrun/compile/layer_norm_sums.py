"""``native_layer_norm`` as sums, for CPU graphs: the residual add, the norm and its affine in one region.

Core ATen keeps ``native_layer_norm`` whole in the forward, so a compiled GPT-2 block's LayerNorms and the
residual adds around them stayed ATen calls (its forward had no fusion region at all). torch's own
decomposition computes the statistics with ``var_mean``, which no region takes: an ATen call between two
small regions, no faster (docs/compiler.md, 2026-12-06). Here the mean and then the centred squares' mean
are plain row sums, which the C++ regions chain (the norm's input, its two reductions and the affine in
one pass over each row). Two passes, as ATen's kernel and torch's reference are stable: not the one-pass
sum of squares, which cancels. Its outputs are ``native_layer_norm``'s (the output, the mean and the
reciprocal standard deviation, kept over the normalised dimensions), so the backward is the same
``native_layer_norm_backward``, decomposed as before.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def layer_norm_by_sums(input: Tensor, normalized_shape: list[int], weight: Tensor | None, bias: Tensor | None,
                       eps: float) -> tuple[Tensor, Tensor, Tensor]:
    dims = list(range(input.ndim - len(normalized_shape), input.ndim))
    count = math.prod(normalized_shape)
    x = input.contiguous()
    acc = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x  # statistics in fp32 at least
    mean = acc.sum(dims, keepdim=True) / count
    centred = acc - mean
    rstd = torch.rsqrt((centred * centred).sum(dims, keepdim=True) / count + eps)
    out = centred * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    out = out.to(x.dtype)
    if x.device.type == "cpu":  # as ATen's CPU kernel returns them
        mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    return out, mean, rstd

"""Block-causal attention for document packing (``data.packing: document``).

A packed window holds several documents; each token attends only to the earlier tokens of its own
document. The documents are given by ``positions_BT``, each token's position inside its document
(0 where a document starts, as the loader builds it), which is also what rotary embeddings read.

The attention is computed one document at a time (a causal SDPA kernel on each ``[start, stop)`` span
of each row), so the work is the sum of the documents' squared lengths and no T x T mask exists. The
spans are data: a Python loop over them would break Dynamo's graph or recompile it for every batch,
so the whole computation is one custom op, opaque to the compiler, with its backward as a second op
(AOTAutograd puts both in the joint graph; accelrun's executors run them as ATen calls).

On the CPU the forward keeps each span's log-sum-exp and the backward calls the flash kernel's
backward on the same span (nothing recomputed). Elsewhere the forward calls
``F.scaled_dot_product_attention`` per span and the backward recomputes that span under autograd.

Shape legend: B batch, H heads, T window, E head dim, S a document span's length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_spans_of(positions_BT: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the ``(start, stop)`` spans of its documents: a span starts where the position is 0.
    A row whose first position is not 0 still starts a span there (the loader never builds one)."""
    B, T = positions_BT.shape
    starts = torch.nonzero(positions_BT == 0).tolist()  # one host read for the whole batch
    per_row: list[list[int]] = [[0] for _ in range(B)]
    for b, t in starts:
        if t > 0:
            per_row[b].append(t)
    return [list(zip(row, [*row[1:], T], strict=True)) for row in per_row]


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)


@torch.library.custom_op("accelrun::document_attention", mutates_args=())
def document_attention_fwd(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                           positions_BT: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (B, H, T, E), log-sum-exp (B, H, T) fp32; CPU only, zeros elsewhere)."""
    B, H, T, _ = q_BHTE.shape
    out_BHTE = torch.empty_like(q_BHTE)
    lse_BHT = torch.zeros(B, H, T, dtype=torch.float32, device=q_BHTE.device)
    on_cpu = q_BHTE.device.type == "cpu"
    for b, spans in enumerate(document_spans_of(positions_BT)):
        for start, stop in spans:
            q, k, v = (x[b : b + 1, :, start:stop] for x in (q_BHTE, k_BHTE, v_BHTE))  # (1, H, S, E)
            if on_cpu:
                o, lse = _cpu_flash(q, k, v, scale)
                lse_BHT[b : b + 1, :, start:stop] = lse
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            out_BHTE[b : b + 1, :, start:stop] = o
    return out_BHTE, lse_BHT


@document_attention_fwd.register_fake
def _(q_BHTE, k_BHTE, v_BHTE, positions_BT, scale):
    B, H, T, _ = q_BHTE.shape
    return torch.empty_like(q_BHTE), q_BHTE.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("accelrun::document_attention_backward", mutates_args=())
def document_attention_bwd(grad_BHTE: torch.Tensor, q_BHTE: torch.Tensor, k_BHTE: torch.Tensor,
                           v_BHTE: torch.Tensor, out_BHTE: torch.Tensor, lse_BHT: torch.Tensor,
                           positions_BT: torch.Tensor, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq_BHTE, dk_BHTE, dv_BHTE = (torch.empty_like(x) for x in (q_BHTE, k_BHTE, v_BHTE))
    on_cpu = q_BHTE.device.type == "cpu"
    for b, spans in enumerate(document_spans_of(positions_BT)):
        for start, stop in spans:
            q, k, v, g = (x[b : b + 1, :, start:stop] for x in (q_BHTE, k_BHTE, v_BHTE, grad_BHTE))
            if on_cpu:
                o, lse = out_BHTE[b : b + 1, :, start:stop], lse_BHT[b : b + 1, :, start:stop]
                dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g.contiguous(), q, k, v, o, lse.contiguous(), 0.0, True, scale=scale)
            else:  # recompute the span's attention and differentiate it
                with torch.enable_grad():
                    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                    dq, dk, dv = torch.autograd.grad(o, (q, k, v), g)
            dq_BHTE[b : b + 1, :, start:stop] = dq
            dk_BHTE[b : b + 1, :, start:stop] = dk
            dv_BHTE[b : b + 1, :, start:stop] = dv
    return dq_BHTE, dk_BHTE, dv_BHTE


@document_attention_bwd.register_fake
def _(grad_BHTE, q_BHTE, k_BHTE, v_BHTE, out_BHTE, lse_BHT, positions_BT, scale):
    return torch.empty_like(q_BHTE), torch.empty_like(k_BHTE), torch.empty_like(v_BHTE)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, positions, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, positions)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, positions = ctx.saved_tensors
    dq, dk, dv = document_attention_bwd(grad_out.contiguous(), q, k, v, out, lse, positions, ctx.scale)
    return dq, dk, dv, None, None


document_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def document_attention(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                       positions_BT: torch.Tensor) -> torch.Tensor:
    """Causal attention inside each document of each row; k and v have q's head count. (B, H, T, E)."""
    scale = q_BHTE.shape[-1] ** -0.5
    return document_attention_fwd(q_BHTE, k_BHTE, v_BHTE, positions_BT, scale)[0]

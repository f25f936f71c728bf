"""Block-causal attention for document packing (``data.packing: document``).

A packed window holds several documents; each token attends only to the earlier tokens of its own
document. The documents are given by ``positions_BT``, each token's position inside its document
(0 where a document starts, as the loader builds it), which is also what rotary embeddings read.

No kernel builds a T x T mask: the work follows the documents (the sum of their squared lengths on
the CPU, the blocks that touch a document on CUDA). Where the documents start is data: a Python loop
over them would break Dynamo's graph or recompile it for every batch, so the whole computation is one
custom op, opaque to the compiler, with its backward as a second op (AOTAutograd puts both in the
joint graph; accelrun's executors run them as ATen calls).

Kernels, by device:
- CPU: the flash kernel on each span; the forward keeps each span's log-sum-exp and the backward calls
  the kernel's backward on the same span (nothing recomputed). (FlexAttention has no backward on the
  CPU in torch 2.13, and its forward there is a dense reference.)
- CUDA (any other device): FlexAttention with a document mask (a ``BlockMask``: blocks wholly outside
  every document are skipped), compiled by Inductor once per shape, inside this op; the backward
  recomputes it under autograd.

Shape legend: B batch, H heads, T window, E head dim, S a document span's length.
"""

from __future__ import annotations

import functools

import torch

from accelrun.op_source_lookup import known_to_inspect

known_to_inspect(__name__)  # before the ops below: torch.library looks up their source lines


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


def document_ids_of(positions_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) int: which document of its row each token is in (counting from 1)."""
    starts_BT = positions_BT == 0
    starts_BT[:, 0] = True  # a window's first token starts a span, whatever its position
    return starts_BT.cumsum(1)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                            positions_BT: torch.Tensor, scale: float, *, compiled: bool = True) -> torch.Tensor:
    """FlexAttention restricted to each document (CUDA's kernel; ``compiled=False`` runs torch's reference,
    which tests use on the CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    docs_BT = document_ids_of(positions_BT)
    B, _, T, _ = q_BHTE.shape

    def same_document_causal(b, h, q_idx, kv_idx):
        return (docs_BT[b, q_idx] == docs_BT[b, kv_idx]) & (kv_idx <= q_idx)

    block_mask = create_block_mask(same_document_causal, B, None, T, T, device=q_BHTE.device, _compile=compiled)
    attend = _compiled_flex() if compiled else flex_attention
    return attend(q_BHTE, k_BHTE, v_BHTE, block_mask=block_mask, scale=scale)


@torch.library.custom_op("accelrun::document_attention", mutates_args=())
def document_attention_fwd(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, v_BHTE: torch.Tensor,
                           positions_BT: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (B, H, T, E), log-sum-exp (B, H, T) fp32: the CPU kernel's, zeros elsewhere)."""
    B, H, T, _ = q_BHTE.shape
    lse_BHT = torch.zeros(B, H, T, dtype=torch.float32, device=q_BHTE.device)
    if q_BHTE.device.type != "cpu":
        return flex_document_attention(q_BHTE, k_BHTE, v_BHTE, positions_BT, scale), lse_BHT
    out_BHTE = torch.empty_like(q_BHTE)
    for b, spans in enumerate(document_spans_of(positions_BT)):
        for start, stop in spans:
            q, k, v = (x[b : b + 1, :, start:stop] for x in (q_BHTE, k_BHTE, v_BHTE))  # (1, H, S, E)
            out_BHTE[b : b + 1, :, start:stop], lse_BHT[b : b + 1, :, start:stop] = _cpu_flash(q, k, v, scale)
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
    if q_BHTE.device.type != "cpu":  # recompute FlexAttention and differentiate it
        with torch.enable_grad():
            q, k, v = (x.detach().requires_grad_() for x in (q_BHTE, k_BHTE, v_BHTE))
            o = flex_document_attention(q, k, v, positions_BT, scale)
            return torch.autograd.grad(o, (q, k, v), grad_BHTE)
    dq_BHTE, dk_BHTE, dv_BHTE = (torch.empty_like(x) for x in (q_BHTE, k_BHTE, v_BHTE))
    for b, spans in enumerate(document_spans_of(positions_BT)):
        for start, stop in spans:
            q, k, v, g, o = (x[b : b + 1, :, start:stop] for x in (q_BHTE, k_BHTE, v_BHTE, grad_BHTE, out_BHTE))
            lse = lse_BHT[b : b + 1, :, start:stop]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g.contiguous(), q, k, v, o, lse.contiguous(), 0.0, True, scale=scale)
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

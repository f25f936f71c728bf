"""Document packing (``data.packing: document``): what a window carries besides its tokens.

The windows are the same as concat packing's (``loader``); each batch also says where the
documents inside it start, as each token's position in its document (``positions``: 0 at a
document's first token, and at the window's first token, which may be the middle of a document).
The model restarts rotary positions there and keeps attention inside each document
(``accelrun.models.document_attention``). The target that crosses a boundary (a document's last
token predicting the next one's first) is -100, so it is in no loss: a document's loss then does not
depend on what it is packed with.

Shapes: B = micro_batch, T = seq_len.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from accelrun.data.errors import DataError
from accelrun.data.loss_mask import mask_targets
from accelrun.data.stream import TokenStream, document_spans

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: such a target is in no loss


class DocumentBatch(NamedTuple):
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64: inputs shifted left by one; -100 where a document begins
    positions: torch.Tensor  # (B, T) int64: each input token's position in its document


def require_document_index(stream: TokenStream) -> torch.Tensor:
    """The stream's document starts, or a DataError naming the key when its source records none."""
    if stream.document_starts is None:
        source = stream.fingerprint.get("source", "?")
        raise DataError(
            f"data.packing: document needs to know where documents start, and data.source {source!r} does not "
            "record it (synthetic data; token files prepared before the document index); use data.packing: "
            "concat, or a source that keeps documents (documents, text, or token files prepared again)"
        )
    return stream.document_starts


def document_window(starts: torch.Tensor, start: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the window of ``seq_len + 1`` tokens at ``start``: (positions (T,), crossing (T,) bool, True
    where target t, the window's token t + 1, begins a document).

    >>> pos, crossing = document_window(torch.tensor([0, 3]), 0, 5)   # documents [0, 3) and [3, ...)
    >>> pos.tolist(), crossing.tolist()
    ([0, 1, 2, 0, 1], [False, False, True, False, False])
    """
    spans_S = document_spans(starts, start, start + seq_len + 1)  # offsets in [0, T]; [0] == 0
    idx_T = torch.arange(seq_len)
    span_of_T = torch.searchsorted(spans_S, idx_T, right=True) - 1
    positions_T = idx_T - spans_S[span_of_T]
    crossing_T = torch.zeros(seq_len + 1, dtype=torch.bool)
    crossing_T[spans_S] = True
    return positions_T, crossing_T[1:]


def document_window_batch(stream: TokenStream, window_starts: list[int], seq_len: int) -> DocumentBatch:
    """The windows at ``window_starts`` (token offsets), with their positions and boundary targets masked."""
    starts = require_document_index(stream)
    rows, positions, crossings = [], [], []
    for start in window_starts:
        rows.append(stream.read(start, start + seq_len + 1))
        pos_T, crossing_T = document_window(starts, start, seq_len)
        positions.append(pos_T)
        crossings.append(crossing_T)
    w_BT1 = torch.stack(rows)  # (B, T+1)
    targets_BT = w_BT1[:, 1:].clone()
    targets_BT[torch.stack(crossings)] = IGNORE_INDEX
    mask_targets(stream, window_starts, seq_len, targets_BT)  # chat data: only the tokens its loss_on counts
    return DocumentBatch(w_BT1[:, :-1].contiguous(), targets_BT, torch.stack(positions))

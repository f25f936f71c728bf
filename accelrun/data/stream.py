"""A token stream: one long 1-D sequence of token ids that the loader cuts into windows.

Sources (builtin, text, tokens, synthetic) each return a ``TokenStream``. The loader only needs
its length and a way to read ``[start, stop)`` as int64; how the tokens are held (an in-memory
uint16 tensor, memory-mapped files, chunks generated on demand) is the source's business.

Every stream carries a ``fingerprint``: a small JSON-able dict describing what was read, with a
short content hash under ``"sha256"``. Runs record it, and a loader state saved on one stream
refuses to load onto a stream with a different hash.

A stream may also know where its documents start: ``document_starts``, a 1-D int64 tensor of the
offset of each document's first token in the stream, ascending, starting with 0 (the EOS that ends a
document belongs to it, so document ``i`` spans ``[starts[i], starts[i + 1])`` and the last one runs
to the end of the stream). ``None`` means the boundaries are unknown (synthetic data, token files
prepared before the index existed). ``data.packing: document`` reads it; ``document_spans`` cuts it
to one window.

A stream may also carry a loss mask: ``read_loss_mask(start, stop)``, one bool per token, True where
the token is in the loss as a target (chat data with ``data.loss_on: assistant``: what the assistant
said). ``None`` means every token is. The loader applies it to a window's targets in one place
(``accelrun.data.loss_mask``).
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch


def short_hash(h: Any) -> str:
    """The first 16 hex digits of a ``hashlib`` digest: plenty to tell data sets apart, short enough
    to read in a report."""
    return h.hexdigest()[:16]


class TokenStream(ABC):
    """Interface: ``len(stream)`` tokens; ``read(start, stop)`` returns them as a 1-D int64 tensor."""

    fingerprint: dict[str, Any]
    vocab_size: int  # every id in the stream is < vocab_size
    # int64 offsets of each document's first token, ascending, [0] == 0; None = boundaries unknown.
    document_starts: torch.Tensor | None = None

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def read(self, start: int, stop: int) -> torch.Tensor: ...

    def read_loss_mask(self, start: int, stop: int) -> torch.Tensor | None:
        """Tokens ``[start, stop)``'s loss mask (bool; True = in the loss), or None: all of them are."""
        return None


class TensorStream(TokenStream):
    """Tokens held in one or more 1-D tensors (any integer dtype, e.g. uint16 or a memory map),
    read as if they were concatenated. Nothing is copied until ``read``."""

    def __init__(self, segments: Sequence[torch.Tensor], *, vocab_size: int, fingerprint: dict[str, Any],
                 document_starts: torch.Tensor | None = None, loss_mask: Sequence[torch.Tensor] | None = None):
        self.segments = [s for s in segments if s.numel() > 0]
        for s in self.segments:
            if s.dim() != 1:
                raise ValueError(f"token segments must be 1-D, got shape {tuple(s.shape)}")
        # starts[i] is the global index of segments[i][0]; starts[-1] is the total length.
        self.starts = [0]
        for s in self.segments:
            self.starts.append(self.starts[-1] + s.numel())
        self.vocab_size = vocab_size
        self.fingerprint = fingerprint
        self.document_starts = check_document_starts(document_starts, self.starts[-1])
        # One bool per token, in segments of its own (a mask need not be cut where the tokens are).
        self.loss_mask = None if loss_mask is None else TensorStream(
            loss_mask, vocab_size=2, fingerprint={"loss_mask_of": fingerprint.get("sha256")})
        if self.loss_mask is not None and len(self.loss_mask) != self.starts[-1]:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {self.starts[-1]} tokens")

    @property
    def tokens(self) -> torch.Tensor:
        """The whole stream as one tensor (a view when there is a single segment, else a copy)."""
        if len(self.segments) == 1:
            return self.segments[0]
        if not self.segments:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(self.segments)

    def __len__(self) -> int:
        return self.starts[-1]

    def read_loss_mask(self, start: int, stop: int) -> torch.Tensor | None:
        if self.loss_mask is None:
            return None
        return self.loss_mask.read(start, stop).bool()

    def read(self, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"read [{start}, {stop}) outside a stream of {len(self)} tokens")
        parts = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            seg, base = self.segments[i], self.starts[i]
            end = min(stop, self.starts[i + 1])
            parts.append(seg[start - base : end - base])
            start, i = end, i + 1
        if len(parts) == 1:
            return parts[0].to(torch.int64)
        return torch.cat([p.to(torch.int64) for p in parts]) if parts else torch.empty(0, dtype=torch.int64)


def check_document_starts(starts: torch.Tensor | None, n_tokens: int) -> torch.Tensor | None:
    """``starts`` as int64, checked: 1-D, ascending, first 0, all inside ``n_tokens`` (an empty stream
    has no documents). A wrong index would silently mask the wrong tokens, so it fails loudly here."""
    if starts is None:
        return None
    starts = starts.to(torch.int64)
    if starts.dim() != 1:
        raise ValueError(f"document_starts must be 1-D, got shape {tuple(starts.shape)}")
    if n_tokens == 0:
        if starts.numel():
            raise ValueError("document_starts of an empty stream must be empty")
        return starts
    if starts.numel() == 0 or int(starts[0]) != 0 or int(starts[-1]) >= n_tokens:
        raise ValueError(f"document_starts must start at 0 and stay below {n_tokens} tokens")
    if starts.numel() > 1 and not bool((starts[1:] > starts[:-1]).all()):
        raise ValueError("document_starts must be strictly ascending")
    return starts


def document_spans(starts: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The offsets, relative to ``start``, at which a document begins inside ``[start, stop)``; the
    first entry is always 0 (the window's first token begins a span, maybe mid-document).

    >>> document_spans(torch.tensor([0, 5, 9]), 3, 12).tolist()
    [0, 2, 6]
    """
    lo = int(torch.searchsorted(starts, start, right=True))
    hi = int(torch.searchsorted(starts, stop, right=False))
    inner = starts[lo:hi] - start
    return torch.cat([torch.zeros(1, dtype=torch.int64), inner])

"""A token stream: one long 1-D sequence of token ids that the loader cuts into windows.

Sources (builtin, text, tokens, synthetic) each return a ``TokenStream``. The loader only needs
its length and a way to read ``[start, stop)`` as int64; how the tokens are held (an in-memory
uint16 tensor, memory-mapped files, chunks generated on demand) is the source's business.

Every stream carries a ``fingerprint``: a small JSON-able dict describing what was read, with a
short content hash under ``"sha256"``. Runs record it, and a loader state saved on one stream
refuses to load onto a stream with a different hash.
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

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def read(self, start: int, stop: int) -> torch.Tensor: ...


class TensorStream(TokenStream):
    """Tokens held in one or more 1-D tensors (any integer dtype, e.g. uint16 or a memory map),
    read as if they were concatenated. Nothing is copied until ``read``."""

    def __init__(self, segments: Sequence[torch.Tensor], *, vocab_size: int, fingerprint: dict[str, Any]):
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

"""The ``synthetic`` source: seeded uniform random tokens, generated on demand.

The stream is cut into fixed chunks of ``CHUNK`` tokens; chunk ``c`` comes from its own generator
seeded by ``(seed, c)``, so any window can be produced without generating what precedes it and
memory stays at a few cached chunks however long the stream is. The tokens at a position depend
only on the seed and the vocabulary size, not on the stream's length.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from accelrun.data.seeding import generator
from accelrun.data.stream import TokenStream, short_hash

CHUNK = 4096  # part of the definition of the data: changing it changes every token
_CACHED_CHUNKS = 16
DEFAULT_TOKENS = 1 << 22
_MIN_TOKENS = 1 << 20


def synthetic_length(min_tokens: int | None) -> int:
    """Stream length for a run that needs ``min_tokens``: rounded up to a power of two (at least
    1 Mi tokens), so a resumed run that asks for somewhat more still gets the same stream."""
    if min_tokens is None:
        return DEFAULT_TOKENS
    n = max(min_tokens, _MIN_TOKENS)
    return 1 << (n - 1).bit_length()


class SyntheticStream(TokenStream):
    """``length`` tokens drawn uniformly from ``[0, vocab_size)``."""

    def __init__(self, *, vocab_size: int, length: int, seed: int):
        if vocab_size < 1 or length < 0:
            raise ValueError(f"vocab_size must be >= 1 and length >= 0, got {vocab_size}, {length}")
        self.vocab_size = vocab_size
        self.length = length
        self.seed = seed
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.fingerprint = {
            "source": "synthetic",
            "vocab_size": vocab_size,
            "tokens": length,
            "seed": seed,
            # Generated, not read: the parameters are the content, so they are what is hashed.
            "sha256": short_hash(hashlib.sha256(f"synthetic:{CHUNK}:{vocab_size}:{seed}".encode())),
        }

    def __len__(self) -> int:
        return self.length

    def _chunk(self, c: int) -> torch.Tensor:
        chunk = self._cache.get(c)
        if chunk is None:
            g = generator("synthetic", self.seed, self.vocab_size, c)
            chunk = torch.randint(0, self.vocab_size, (CHUNK,), generator=g, dtype=torch.int64)
            self._cache[c] = chunk
            if len(self._cache) > _CACHED_CHUNKS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(c)
        return chunk

    def read(self, start: int, stop: int) -> torch.Tensor:
        if not 0 <= start <= stop <= self.length:
            raise IndexError(f"read [{start}, {stop}) outside a stream of {self.length} tokens")
        parts = []
        while start < stop:
            c, off = divmod(start, CHUNK)
            end = min(stop, (c + 1) * CHUNK)
            parts.append(self._chunk(c)[off : off + end - start])
            start = end
        if len(parts) == 1:
            return parts[0].clone()
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

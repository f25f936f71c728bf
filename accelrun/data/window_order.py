"""A shuffled order of a corpus's windows that is computed, not stored.

``torch.randperm(n)`` holds 8 bytes a window: 0.8 GiB for 24 G tokens at ``seq_len`` 256, 15 GiB for
15 T tokens at 8,192, on every rank. ``WindowOrder`` is a bijection of ``[0, n)`` evaluated for the
positions a step reads: a 4-round Feistel network on the smallest even number of bits that holds
``n - 1`` (each round mixes one half with a keyed 32-bit integer hash of the other), cycle-walked
until the value falls below ``n`` (the domain is under ``4 n``, so a few rounds at most on average).
Integer arithmetic only (numpy's uint64, which wraps as the hash needs): the same order on every
machine, rank and version of the libraries. ``slice`` computes 64K positions at a time, so a step's 64
windows cost ~14 us.

>>> order = WindowOrder(10, "shuffle", 0, 0)
>>> sorted(order.at(torch.arange(10)).tolist()) == list(range(10))
True
"""

from __future__ import annotations

import numpy as np
import torch

from accelrun.data.errors import DataError
from accelrun.data.seeding import derive_seed

ROUNDS = 4
CHUNK = 1 << 16  # positions computed together by ``slice`` (512 KiB): numpy's per-call cost spread thin
_M32 = np.uint64(0xFFFFFFFF)
_MUL1, _MUL2 = np.uint64(0x7FEB352D), np.uint64(0x846CA68B)  # a well-mixing 32-bit hash's multipliers


class WindowOrder:
    """Position ``p`` of an epoch reads window ``at(p)``; ``seed_parts`` pick the permutation
    (``shuffle=False``: the identity)."""

    def __init__(self, n: int, *seed_parts: object, shuffle: bool = True) -> None:
        if n < 1:
            raise ValueError(f"an order of {n} windows")
        self.n, self.shuffle = n, shuffle
        half = (max(2, (n - 1).bit_length()) + 1) // 2
        self.half, self.mask = np.uint64(half), np.uint64((1 << half) - 1)
        self.keys = [np.uint64(derive_seed(*seed_parts, "round", r) & 0xFFFFFFFF) for r in range(ROUNDS)]
        self._chunk_start, self._chunk = -1, []

    def slice(self, start: int, stop: int) -> list[int]:
        """The windows read at positions ``start .. stop - 1``, in order, from cached chunks of ``CHUNK``."""
        out: list[int] = []
        while start < stop:
            first = start - start % CHUNK
            if self._chunk_start != first:
                self._chunk = self.at(torch.arange(first, min(first + CHUNK, self.n))).tolist()
                self._chunk_start = first
            end = min(stop, first + CHUNK)
            out += self._chunk[start - first:end - first]
            start = end
        return out

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The windows read at ``positions`` (integers, each in ``[0, n)``), as int64."""
        positions = positions.reshape(-1)
        if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < self.n):
            raise ValueError(f"positions outside [0, {self.n})")  # outside the domain the walk never ends
        if not self.shuffle:
            return positions.to(torch.int64).clone()
        x = self._permute(positions.numpy().astype(np.uint64))
        while (outside := x >= self.n).any():  # cycle-walk: a bijection of [0, n) from one of [0, 4^half)
            x[outside] = self._permute(x[outside])
        return torch.from_numpy(x.astype(np.int64))

    def _permute(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right


def _mix(v: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (xor-shift-multiply rounds; the products wrap in uint64 and are cut to 32 bits)."""
    v = v & _M32
    v ^= v >> np.uint64(16)
    v = (v * _MUL1) & _M32
    v ^= v >> np.uint64(15)
    v = (v * _MUL2) & _M32
    return v ^ (v >> np.uint64(16))


def check_state_version(version: object, expected: int, shuffle: bool, what: str) -> None:
    """Refuse an iterator state of another version, naming why. Version 1 (the loader's and the mix's)
    read shuffled windows in ``torch.randperm``'s order, which this module does not reproduce; read in
    order, it is the identity then as now, and resumes."""
    if version == expected or (version == 1 and not shuffle):
        return
    raise DataError(f"data state: {what} version {version} is not supported (expected {expected})"
                    + (": a checkpoint of an earlier accelrun, whose shuffled window order this one does not "
                       "reproduce; finish that run with the version that started it, or start afresh "
                       "(checkpoint.resume=none)" if version == 1 else ""))

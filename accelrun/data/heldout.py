"""A deterministic held-out split for evaluation (``eval.split``): the last windows of the stream.

With ``n = (len(stream) - 1) // seq_len`` windows, the last ``k = max(1, round(n * split))`` are held
out. Training reads a stream cut after window ``n - k - 1`` (``(n - k) * seq_len + 1`` tokens, so its last
target is the held-out part's first input token and no held-out target is ever trained on). Every rank
computes the same split; rank ``r`` of ``dp_size`` evaluates batches ``r, r + dp_size, ...`` of
``micro_batch`` held-out windows in order.
"""

from __future__ import annotations

from typing import Any

import torch

from accelrun.data.errors import DataError
from accelrun.data.loader import window_batch
from accelrun.data.stream import TokenStream


def heldout_windows(n_windows: int, split: float) -> int:
    return max(1, round(n_windows * split))


class PrefixStream(TokenStream):
    """The first ``length`` tokens of ``stream`` (what training may read)."""

    def __init__(self, stream: TokenStream, length: int, held_out_windows: int):
        self.inner, self.length = stream, length
        self.vocab_size = stream.vocab_size
        self.fingerprint: dict[str, Any] = {**stream.fingerprint, "held_out_windows": held_out_windows}
        inner = stream.document_starts  # the documents that begin inside the prefix
        self.document_starts = None if inner is None else inner[: int(torch.searchsorted(inner, length))]

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, stop: int) -> torch.Tensor:
        if stop > self.length:
            raise IndexError(f"read past the training part ({stop} > {self.length})")
        return self.inner.read(start, stop)

    def read_loss_mask(self, start: int, stop: int) -> torch.Tensor | None:
        return self.inner.read_loss_mask(start, stop)


class HeldOutBatches:
    """This rank's evaluation batches over the held-out windows: the same ones at every evaluation."""

    def __init__(self, stream: TokenStream, *, seq_len: int, micro_batch: int, split: float | None, max_batches: int,
                 dp_rank: int = 0, dp_size: int = 1, packing: str = "concat"):
        """``split`` None: every window of ``stream`` is an evaluation window (eval.paths: data of its own)."""
        n = max(len(stream) - 1, 0) // seq_len
        if split is None:
            if n < micro_batch * dp_size:
                raise DataError(f"eval.paths: the evaluation data has {n} windows of train.seq_len {seq_len}, fewer "
                                f"than one batch of {micro_batch * dp_size} (train.micro_batch × data-parallel ranks); "
                                "add evaluation data or lower train.micro_batch")
        k = n if split is None else heldout_windows(n, split)
        if split is not None and (n - k < 1 or k < micro_batch * dp_size):
            raise DataError(
                f"eval.split {split}: the data has {n} windows of train.seq_len {seq_len}; holding out {k} leaves "
                f"{n - k} for training and needs at least {micro_batch * dp_size} (train.micro_batch × data-parallel "
                "ranks) held out; raise eval.split, add data, or lower micro_batch"
            )
        self.stream, self.seq_len, self.micro_batch = stream, seq_len, micro_batch
        self.packing = packing  # data.packing: held-out windows are built as training's are
        self.first = n - k  # the first held-out window
        self.n_heldout = k
        n_batches = min(max_batches, k // (micro_batch * dp_size))  # the same count on every rank
        self.batches = [dp_rank + j * dp_size for j in range(n_batches)]

    def train_stream(self) -> PrefixStream:
        return PrefixStream(self.stream, self.first * self.seq_len + 1, self.n_heldout)

    def __iter__(self):
        T, B = self.seq_len, self.micro_batch
        for b in self.batches:
            windows = range(self.first + b * B, self.first + b * B + B)
            yield window_batch(self.stream, [i * T for i in windows], T, self.packing)

"""Packing, shuffling, per-rank sharding and resumable iteration over a token stream.

Packing: the stream is cut into ``n_windows = (len(stream) - 1) // seq_len`` windows of
``seq_len + 1`` tokens, window ``i`` starting at ``i * seq_len``. Consecutive windows share one
boundary token (the last target of window ``i`` is the first input of window ``i + 1``), so every
token is trained on as a target exactly once per epoch. Document boundaries are not respected:
EOS tokens inside a window separate documents. With ``packing="document"`` the windows are the same,
and each batch is a ``DocumentBatch`` that also carries each token's position in its document and
masks the targets that cross a boundary (``accelrun.data.document_packing``).

Order: each epoch reads the windows in a permutation seeded by ``(seed, epoch)`` (identity when
shuffling is off), a ``WindowOrder``: computed for the positions a step reads, never held whole
(8 bytes a window would grow with the corpus). Every rank computes the same permutation.

Sharding: a global step reads the next ``dp_size * micro_batch`` windows of the permutation; rank
``r`` takes the ``r``-th block of ``micro_batch`` of them. The ranks' batches are therefore disjoint,
and concatenated in rank order they are exactly the batch one unsharded iterator with
``micro_batch * dp_size`` would produce. An epoch ends when fewer than ``dp_size * micro_batch``
windows remain; the remainder is skipped that epoch (a different remainder each epoch when shuffled).

State: ``position`` counts windows of the epoch's permutation consumed by all ranks together.
It is the same number on every rank, which is what makes re-sharding possible: a state saved at
``dp_size=2`` loaded into an iterator with ``dp_size=1`` (or another ``micro_batch``) continues
from the same point of the same permutation.

Legend for shapes: B = micro_batch, T = seq_len.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from accelrun.data.document_packing import DocumentBatch, document_window_batch, require_document_index
from accelrun.data.errors import DataError
from accelrun.data.loss_mask import mask_targets
from accelrun.data.stream import TokenStream
from accelrun.data.window_order import WindowOrder, check_state_version

STATE_VERSION = 2  # 2: windows in WindowOrder's order (1: torch.randperm's, not reproduced)


class Batch(NamedTuple):
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64: inputs shifted left by one token; IGNORE_INDEX where out of the loss


def window_batch(stream: TokenStream, window_starts: list[int], seq_len: int, packing: str) -> Batch | DocumentBatch:
    """The batch of ``stream``'s windows of ``seq_len + 1`` tokens at ``window_starts`` (token offsets):
    what a window becomes under ``packing``. Which windows are read is the iterators' business."""
    T = seq_len
    if packing == "document":
        return document_window_batch(stream, window_starts, T)
    rows = [stream.read(s, s + T + 1) for s in window_starts]
    w_BT1 = torch.stack(rows)  # (B, T+1)
    targets_BT = w_BT1[:, 1:].contiguous()
    mask_targets(stream, window_starts, T, targets_BT)  # chat: only what counts
    return Batch(w_BT1[:, :-1].contiguous(), targets_BT)


class TokenBatchIterator:
    """An endless iterator of ``Batch(inputs, targets)`` for one data-parallel rank.

    >>> it = TokenBatchIterator(stream, seq_len=256, micro_batch=8, seed=0, dp_rank=0, dp_size=2)
    >>> x_BT, y_BT = next(it)
    >>> saved = it.state_dict()          # later: it2.load_state_dict(saved) continues identically
    """

    def __init__(
        self,
        stream: TokenStream,
        *,
        seq_len: int,
        micro_batch: int,
        seed: int,
        shuffle: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
        packing: str = "concat",
    ):
        if seq_len < 1 or micro_batch < 1 or dp_size < 1:
            raise ValueError(
                f"seq_len, micro_batch and dp_size must be >= 1: {seq_len}, {micro_batch}, {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.stream = stream
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self.shuffle = shuffle
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.packing = packing  # data.packing: concat | document
        if packing == "document":
            require_document_index(stream)
        self.n_windows = max(len(stream) - 1, 0) // seq_len
        if self.n_windows < self.step_windows:
            needed = self.step_windows * seq_len + 1
            source = stream.fingerprint.get("source", "?")
            raise DataError(
                f"data ({source}): found {len(stream)} tokens, need at least {needed} for one batch on each "
                f"rank (dp_size {dp_size} × train.micro_batch {micro_batch} × train.seq_len {seq_len} + 1); "
                "add data, or lower micro_batch or seq_len"
            )
        self.epoch = 0
        self.position = 0  # windows of this epoch's order consumed by all ranks together
        self._order: WindowOrder | None = None
        self._order_key: tuple | None = None

    @property
    def step_windows(self) -> int:
        """Windows one global step consumes: ``dp_size * micro_batch``."""
        return self.dp_size * self.micro_batch

    @property
    def batches_per_epoch(self) -> int:
        return self.n_windows // self.step_windows

    @property
    def fingerprint(self) -> str:
        return str(self.stream.fingerprint.get("sha256", ""))

    def epoch_order(self, epoch: int) -> WindowOrder:
        """The order ``epoch`` reads its windows in (the same on every rank; computed, never stored)."""
        key = (epoch, self.seed, self.shuffle)
        if self._order_key != key:
            self._order = WindowOrder(self.n_windows, "shuffle", self.seed, epoch, shuffle=self.shuffle)
            self._order_key = key
        assert self._order is not None
        return self._order

    def __iter__(self) -> TokenBatchIterator:
        return self

    def __next__(self) -> Batch | DocumentBatch:
        # Every rank applies this rule to the same (position, step_windows, n_windows), so all ranks
        # start a new epoch at the same step.
        if self.position + self.step_windows > self.n_windows:
            self.epoch += 1
            self.position = 0
        first = self.position + self.dp_rank * self.micro_batch
        windows = self.epoch_order(self.epoch).slice(first, first + self.micro_batch)
        self.position += self.step_windows
        return window_batch(self.stream, [i * self.seq_len for i in windows], self.seq_len, self.packing)

    def state_dict(self) -> dict[str, Any]:
        """Where the iterator is. Plain ints and strings; identical on every rank but ``dp_rank``."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "n_windows": self.n_windows,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. The data must be the same (same fingerprint and window count);
        ``dp_rank``, ``dp_size`` and ``micro_batch`` may differ (the position is global). The saved
        ``seed`` and ``shuffle`` are adopted: the order of the data belongs to the run being resumed."""
        try:
            version, epoch, position = state["version"], int(state["epoch"]), int(state["position"])
            seed, shuffle = int(state["seed"]), bool(state["shuffle"])
            seq_len, n_windows, fingerprint = (
                int(state["seq_len"]),
                int(state["n_windows"]),
                state["fingerprint"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"data state: malformed or incomplete ({type(e).__name__}: {e})") from None
        check_state_version(version, STATE_VERSION, shuffle, "data")
        if fingerprint != self.fingerprint:
            raise DataError(
                f"data state was saved on different data (fingerprint {fingerprint}, this data is "
                f"{self.fingerprint}: {self.stream.fingerprint}): the data's files or the tokenizer's file changed "
                "since the checkpoint was written, or the data.* settings did; resume with the same data and "
                "tokenizer, or start afresh with checkpoint.resume=none"
            )
        if (seq_len, n_windows) != (self.seq_len, self.n_windows):
            raise DataError(
                f"data state was saved with {n_windows} windows of train.seq_len {seq_len}; this data has "
                f"{self.n_windows} windows of train.seq_len {self.seq_len}"
            )
        if epoch < 0 or not 0 <= position <= n_windows:
            raise DataError(
                f"data state: epoch {epoch} / position {position} out of range ({n_windows} windows)"
            )
        self.epoch, self.position, self.seed, self.shuffle = epoch, position, seed, shuffle

"""``data.mix``: windows drawn from several token streams, each source's share of the windows (so of
the tokens: every window has ``seq_len`` targets) held to its weight.

Which source the ``k``-th window of the run comes from is decided by deficit, not by chance: window
``k`` goes to the source furthest behind its share, the one with the largest
``w_i * (k + 1) + phase_i - taken_i`` (``w`` normalised to sum to 1, ``taken_i`` the windows it gave
so far, ``phase_i`` in [0, 1) drawn from the seed; ties to the lower index). Every source then stays
within about one window of ``w_i * k`` at every ``k``: a random draw would wander by
``sqrt(k * w * (1 - w))`` windows, 1.4% of 1,000 at w = 0.5.
Within a source, windows are read as a lone source's are: an order per pass over the source (a
``WindowOrder`` seeded by the seed, the source's index and the pass), a new one each time it runs out.

State: ``taken`` (windows each source gave so far, all ranks together) decides everything that
follows, so a resumed run reads what an uninterrupted one would have read. Every rank computes the
same schedule; rank ``r`` takes the ``r``-th block of ``micro_batch`` windows of each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from accelrun.data.document_packing import DocumentBatch, require_document_index
from accelrun.data.errors import DataError
from accelrun.data.loader import Batch, window_batch
from accelrun.data.seeding import generator
from accelrun.data.stream import TokenStream
from accelrun.data.window_order import WindowOrder, check_state_version

MIX_STATE_VERSION = 2  # 2: each source's windows in WindowOrder's order (1: torch.randperm's)


class MixedBatchIterator:
    """An endless iterator of batches for one data-parallel rank, drawing windows from ``streams`` in
    proportion to ``weights``.

    >>> it = MixedBatchIterator([web, code], [0.7, 0.3], seq_len=256, micro_batch=8, seed=0)  # doctest: +SKIP
    >>> batch = next(it); saved = it.state_dict()     # it2.load_state_dict(saved) continues identically
    """

    def __init__(self, streams: Sequence[TokenStream], weights: Sequence[float], *, seq_len: int, micro_batch: int,
                 seed: int, shuffle: bool = True, dp_rank: int = 0, dp_size: int = 1, packing: str = "concat"):
        if len(streams) != len(weights) or not streams:
            raise ValueError(f"{len(streams)} streams and {len(weights)} weights: give one weight per stream")
        for i, w in enumerate(weights):
            if not w > 0:
                raise DataError(f"data.mix.{i}.weight = {w}: a weight must be > 0, e.g. 0.1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.streams = list(streams)
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.seq_len, self.micro_batch, self.seed, self.shuffle = seq_len, micro_batch, seed, shuffle
        self.dp_rank, self.dp_size, self.packing = dp_rank, dp_size, packing
        self.n_windows = [max(len(s) - 1, 0) // seq_len for s in self.streams]
        for i, (s, n) in enumerate(zip(self.streams, self.n_windows, strict=True)):
            if n < 1:
                raise DataError(f"data.mix.{i} ({s.fingerprint.get('source', '?')}): found {len(s)} tokens, fewer "
                                f"than one window of train.seq_len {seq_len} + 1; add data or lower seq_len")
            if packing == "document":
                require_document_index(s)
        phases = torch.rand(len(self.streams), generator=generator("mix-phase", seed))
        self.phases = [float(p) for p in phases]
        self.taken = [0] * len(self.streams)  # windows each source gave, all ranks together
        self._orders: dict[tuple[int, int], WindowOrder] = {}

    @property
    def step_windows(self) -> int:
        return self.dp_size * self.micro_batch

    @property
    def position(self) -> int:
        """Windows read so far by all ranks together."""
        return sum(self.taken)

    @property
    def fingerprint(self) -> str:
        return "+".join(str(s.fingerprint.get("sha256", "")) for s in self.streams)

    def next_source(self) -> int:
        """The source of the next window (and count it as taken): the one furthest behind its share."""
        k = self.position
        deficits = [w * (k + 1) + p - t for w, p, t in zip(self.weights, self.phases, self.taken, strict=True)]
        i = max(range(len(deficits)), key=lambda j: (deficits[j], -j))
        self.taken[i] += 1
        return i

    def source_window(self, source: int, index: int) -> int:
        """The window (of the source's own) read as the source's ``index``-th: a fresh order per pass."""
        n = self.n_windows[source]
        epoch, at = divmod(index, n)
        key = (source, epoch)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] != source}  # one pass kept per source
            self._orders[key] = WindowOrder(n, "mix-shuffle", self.seed, source, epoch, shuffle=self.shuffle)
        return self._orders[key].slice(at, at + 1)[0]

    def __iter__(self) -> MixedBatchIterator:
        return self

    def __next__(self) -> Batch | DocumentBatch:
        # Every rank draws the whole step's windows (the same on each) and keeps its block.
        picks = []
        for _ in range(self.step_windows):
            source = self.next_source()
            picks.append((source, self.source_window(source, self.taken[source] - 1)))
        mine = picks[self.dp_rank * self.micro_batch:(self.dp_rank + 1) * self.micro_batch]
        T = self.seq_len
        rows = [window_batch(self.streams[s], [w * T], T, self.packing) for s, w in mine]
        return type(rows[0])(*(torch.cat(parts) for parts in zip(*rows, strict=True)))

    def state_dict(self) -> dict[str, Any]:
        return {"version": MIX_STATE_VERSION, "mix": True, "taken": list(self.taken), "seed": self.seed,
                "shuffle": self.shuffle, "seq_len": self.seq_len, "weights": list(self.weights),
                "n_windows": list(self.n_windows), "fingerprint": self.fingerprint,
                "micro_batch": self.micro_batch, "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: same sources (fingerprints, windows) and weights; ``dp_size`` and
        ``micro_batch`` may differ (the schedule is global)."""
        try:
            version, taken = state["version"], [int(t) for t in state["taken"]]
            seed, shuffle, seq_len = int(state["seed"]), bool(state["shuffle"]), int(state["seq_len"])
            weights, n_windows, fingerprint = list(state["weights"]), list(state["n_windows"]), state["fingerprint"]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"data state: not a data.mix state, or incomplete ({type(e).__name__}: {e})") from None
        check_state_version(version, MIX_STATE_VERSION, shuffle, "mix")
        if fingerprint != self.fingerprint or n_windows != self.n_windows or seq_len != self.seq_len:
            raise DataError(f"data state was saved on other data.mix sources (fingerprints {fingerprint}, this mix "
                            f"is {self.fingerprint}); resume with the same data.mix")
        if len(weights) != len(self.weights) or any(abs(a - b) > 1e-12 for a, b in
                                                    zip(weights, self.weights, strict=True)):
            raise DataError(f"data state was saved with data.mix weights {weights}, these are {self.weights}; "
                            "resume with the same weights")
        self.taken, self.seed, self.shuffle = taken, seed, shuffle
        self.phases = [float(p) for p in torch.rand(len(self.streams), generator=generator("mix-phase", seed))]
        self._orders = {}

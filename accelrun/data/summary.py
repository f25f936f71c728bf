"""One line on what a run trains on, for the start of `accelrun train`: how many tokens, in how many
documents, and how many sequences of train.seq_len that makes (a corpus of four .txt files is four
documents to ``data.source: text``, which only this line had shown a new user)."""

from __future__ import annotations

from typing import Any

from accelrun.data.loader import TokenBatchIterator
from accelrun.data.mix import MixedBatchIterator
from accelrun.data.stream import TokenStream


def describe_batches(batches: Any, steps: int | None = None, draws_per_step: int = 1) -> str | None:
    """How much ``batches`` (``build_data``'s iterator, or a wrapper holding it as ``inner``) draws from,
    and how many passes over it ``steps`` make where more than one (each step draws ``draws_per_step``
    batches: gradient accumulation), or None for an iterator of another kind."""
    while not isinstance(batches, (TokenBatchIterator, MixedBatchIterator)) and hasattr(batches, "inner"):
        batches = batches.inner
    if isinstance(batches, TokenBatchIterator):
        read = batches.batches_per_epoch * batches.step_windows  # a pass reads whole steps' windows
        said = f"{describe_stream(batches.stream)}, {read:,} sequences of {batches.seq_len:,} a pass"
        passes = steps * draws_per_step / batches.batches_per_epoch if steps and batches.batches_per_epoch else 0
        if passes > 1:  # 300 steps over a new user's 20 files were 43 passes, and nothing said so
            said += f"; train.steps = {steps:,} make {passes:,.1f} passes over it"
        return said
    if isinstance(batches, MixedBatchIterator):
        # (each source's passes too, as one source's line says them: a small one repeating 11 times in a
        # trial's mix was said nowhere)
        drawn = (steps or 0) * draws_per_step * batches.dp_size * batches.micro_batch
        return "; ".join(f"source {i} ({w:.0%} of the sequences): {describe_stream(s)}" + _passes(drawn * w, n)
                         for i, (s, w, n) in enumerate(zip(batches.streams, batches.weights, batches.n_windows,
                                                           strict=True)))
    return None


def _passes(windows: float, n_windows: int) -> str:
    """``, read N times over`` where a run reads a source's windows more than once."""
    passes = windows / n_windows if n_windows else 0
    return f", read {passes:,.1f} times over in train.steps" if passes > 1 else ""


def describe_stream(stream: TokenStream) -> str:
    starts = stream.document_starts
    documents = f" in {len(starts):,} document{'s' if len(starts) != 1 else ''}" if starts is not None else ""
    # eval.every > 0: the held-out tail is not the training stream's (data/heldout.py)
    held_out = stream.fingerprint.get("held_out_windows")
    return f"{len(stream):,} tokens{documents}" + (f" (eval holds out {held_out:,} sequences after them)"
                                                    if held_out else "")

"""Timing training steps of several variants side by side: each variant's first step (capture and
compile included), untimed warm-up rounds, then timed rounds in which every variant runs once in turn,
so that a slow spell of the machine slows all of them (the ratios are then paired by round)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Stepper(Protocol):
    first: float
    times: list[float]

    def step(self, batch: Any) -> float: ...


def interleaved_rounds(variants: Sequence[Stepper], batches: Sequence[Any], warmup: int, rounds: int) -> None:
    """Fills each variant's ``first`` (its first step, on ``batches[0]``) and ``times`` (one step a round,
    cycling through ``batches``). The warm-up cycles through them too: batches of other shapes compile
    there, not in a timed round."""
    for v in variants:  # first step: capture + compile + run (no reset between: it would drop the others')
        v.first = v.step(batches[0])
    for i in range(warmup):
        for v in variants:
            v.step(batches[(1 + i) % len(batches)])
    for r in range(rounds):
        for v in variants:
            v.times.append(v.step(batches[r % len(batches)]))

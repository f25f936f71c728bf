"""Timing training steps of several variants side by side: each variant's first step (capture and
compile included), untimed warm-up rounds, then timed rounds in which every variant runs once in turn,
so that a slow spell of the machine slows all of them (the ratios are then paired by round)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any, Protocol


class Stepper(Protocol):
    first: float
    times: list[float]

    def step(self, batch: Any) -> float: ...


# Warm-up rounds past ``warmup`` while accelrun's CPU products still time their libraries
# (gemm_choice: 10 calls per layout, and a changing length's bucket meets one call every few rounds).
TUNING_ROUNDS = 60


def interleaved_rounds(variants: Sequence[Stepper], batches: Sequence[Any], warmup: int, rounds: int) -> int:
    """Fills each variant's ``first`` (its first step, on ``batches[0]``) and ``times`` (one step a round,
    cycling through ``batches``). The warm-up cycles through them too: batches of other shapes compile
    there, and products choose their library there, not in a timed round. Returns the warm-up rounds run."""
    from accelrun.compile.gemm_choice import undecided_layouts

    for v in variants:  # first step: capture + compile + run (no reset between: it would drop the others')
        v.first = v.step(batches[0])
    done = 0
    while done < warmup or undecided_layouts() and done < warmup + TUNING_ROUNDS:
        for v in variants:
            v.step(batches[(1 + done) % len(batches)])
        done += 1
    for r in range(rounds):
        for v in variants:
            v.times.append(v.step(batches[r % len(batches)]))
    return done


def rounds_for_cycles(rounds: int, lengths: int) -> int:
    """``rounds`` rounded up to whole cycles of ``lengths`` batches (round r runs ``batches[r % lengths]``)."""
    return -(-rounds // lengths) * lengths


def per_cycle(times: Sequence[float], lengths: int) -> list[float]:
    """The step times of each whole cycle through the batches, summed: with batches of several lengths, the
    median of single steps lands on whichever length sorts into the middle (and a ratio of two variants'
    medians on two different lengths); a cycle's time is what a run over that mix of lengths pays."""
    return [sum(times[i:i + lengths]) for i in range(0, len(times) - lengths + 1, lengths)]


def samples_and_step(times: Sequence[float], cycle: int) -> tuple[list[float], float]:
    """The samples two variants' ratio is taken over, and the step time they give: with batches of
    several lengths (``cycle`` of them in turn) each whole cycle summed (``per_cycle``) and a cycle's
    median over its steps; with one length (``cycle`` 1) each step and their median."""
    samples = per_cycle(times, cycle) if cycle > 1 else list(times)
    return samples, statistics.median(samples) / cycle


def per_length_ratio(base: Sequence[float], other: Sequence[float], i: int, lengths: int) -> float:
    """``base``'s median step over ``other``'s, in the rounds whose batch had the ``i``-th length."""
    return statistics.median(base[i::lengths]) / statistics.median(other[i::lengths])


def new_process_env(**extra: str) -> dict[str, str]:
    """The environment of a new process whose start is timed: this one's, but writing Python's bytecode
    caches as a user's install does (a machine that sets PYTHONDONTWRITEBYTECODE recompiles every
    module changed since its cache was written, in each process: 35 ms of ``compile_model`` here)."""
    env = {**os.environ, **extra}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env

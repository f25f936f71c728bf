"""Pipeline schedules: the idle time (bubble) and the micro-batches a stage holds at once.

With ``p`` pipeline ranks and ``m`` micro-batches per flush (accelrun flushes the pipeline once per
accumulation step), a rank is busy for ``m`` units of one micro-batch's forward+backward and idle
for the bubble. ``v`` is the number of stages a rank runs: 1, or for the interleaved schedules, which
loop the model over the ranks, ``parallel.pp_stages_per_rank`` (default 2, the table's); a larger ``v``
shrinks the bubble as much, for ``v`` times the point-to-point sends:

| schedule          | v | bubble (units)   | micro-batches the first rank holds at its peak |
| ----------------- | - | ---------------- | ---------------------------------------------- |
| gpipe             | 1 | p - 1            | m (every forward runs before any backward)     |
| 1f1b              | 1 | p - 1            | min(p, m)                                      |
| interleaved_1f1b  | v | (p - 1) / v      | min(p, m) · (1 + (p - 1) / (p · v))            |
| zero_bubble       | v | (p - 1) / (3v)   | as interleaved_1f1b                            |

The interleaved figures are Megatron-LM's (Narayanan et al., 2021). Zero-bubble schedules split
backward into input and weight gradients and fill the bubble with the latter; ZB-H1 cuts 1F1B's
bubble to about a third at 1F1B's memory (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): the
planner applies that third to the interleaved schedule torch runs (``ScheduleInterleavedZeroBubble``).
"""

from __future__ import annotations

from accelrun.config.schema import PP_STAGES_PER_RANK  # defined once, with the schema

SCHEDULES = tuple(PP_STAGES_PER_RANK)
STAGES_PER_RANK = PP_STAGES_PER_RANK


def bubble_units(schedule: str, p: int, v: int | None = None) -> float:
    """Idle time of a rank per pipeline flush, in units of one micro-batch's forward+backward.
    ``v``: stages per rank (None: the schedule's default)."""
    if p <= 1:
        return 0.0
    v = v or STAGES_PER_RANK[schedule]
    if schedule == "zero_bubble":
        return (p - 1) / (3 * v)
    return (p - 1) / v


def in_flight(schedule: str, p: int, m: int, v: int | None = None) -> float:
    """Micro-batches whose activations the first (most loaded) rank holds at its peak."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    held = float(min(p, m))
    v = v or STAGES_PER_RANK[schedule]
    if v > 1:
        held *= 1 + (p - 1) / (p * v)
    return held


def held_by_rank(schedule: str, p: int, m: int, rank: int, v: int | None = None) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak: the first rank's
    ``in_flight``, the last rank's one (every micro-batch under gpipe), and in between one fewer per
    rank after the first (1F1B warms up ``p - rank`` forwards before its first backward)."""
    if p <= 1 or rank == 0:
        return in_flight(schedule, p, m, v)
    if schedule == "gpipe":
        return float(m)
    if rank == p - 1:
        return 1.0
    return max(1.0, in_flight(schedule, p, m, v) * (p - rank) / p)

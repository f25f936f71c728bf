"""Pipeline schedules: the idle time (bubble) and the micro-batches a stage holds at once.

With ``p`` pipeline ranks and ``m`` micro-batches per flush (accelrun flushes the pipeline once per
accumulation step), a rank is busy for ``m`` units of one micro-batch's forward+backward and idle
for the bubble. ``v`` is the number of stages a rank runs: 1, or for the interleaved schedules, which
loop the model over the ranks, ``parallel.pp_stages_per_rank`` (default 2, the table's); a larger ``v``
shrinks the bubble as much, for ``v`` times the point-to-point sends:

| schedule          | v | bubble (units)   | micro-batches rank ``r`` holds at its peak        |
| ----------------- | - | ---------------- | ------------------------------------------------- |
| gpipe             | 1 | p - 1            | m (every forward runs before any backward)        |
| 1f1b              | 1 | p - 1            | min(m, p - r)                                     |
| interleaved_1f1b  | v | (p - 1) / v      | min(m·v, (v - 1)·q + 2·(p - 1 - r) + 1) / v       |
| zero_bubble       | v | (p - 1) / (3v)   | min(m·v, (v - 1)·q + (p - 1 - r) + 1) / v         |

The held column is torch's own schedules' (``torch.distributed.pipelining.schedules``): a rank runs its
warm-up forwards, then one more before its first backward frees a micro-batch. The looped schedules
count in stage chunks (a micro-batch through one of the rank's ``v`` stages, ``1/v`` of its layers): the
warm-up is ``v - 1`` rounds of ``q`` micro-batches (``q = m / max(1, m // p)``, ``p`` when ``m`` is a
multiple of ``p``) and 2 (zero bubble: 1) per rank after this one, never more than all ``m·v`` chunks.
For ``m`` much larger than ``p`` the first rank's figure is Megatron-LM's ``p + (p - 1) / v`` (Narayanan et
al., 2021); with ``m = p`` it is every micro-batch, as under GPipe; and the last rank holds ``(v - 1)/v``
of a round, not one micro-batch. ``tests/plan/test_plan_pipeline_memory.py`` replays torch's schedules.
Zero bubble counts a chunk as freed by its input gradient; its weight gradient runs later and keeps
the matmuls' inputs meanwhile (not counted).

The bubble's interleaved figures are Megatron-LM's (Narayanan et al., 2021). Zero-bubble schedules split
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
    return held_by_rank(schedule, p, m, 0, v)


# Warm-up forwards a looped schedule adds per rank after this one (torch's ``multiply_factor``).
WARMUP_PER_HOP = {"interleaved_1f1b": 2, "zero_bubble": 1}


def held_by_stage(schedule: str, p: int, m: int, rank: int, v: int | None = None) -> list[int]:
    """Micro-batches in flight at the peak of pipeline rank ``rank``, for each of its stages (local order:
    stages ``rank``, ``rank + p``, ...): a looped schedule's warm-up runs ``per_round`` micro-batches through
    one of its stages, then the next. Their sum over ``v`` is ``held_by_rank``'s. The last rank holds one
    micro-batch of its last stage (the output layer's), not its share of all: a trial's 405B plan counted
    the head's input 12.25 times, 3.9 GiB over."""
    if p <= 1:
        return [1]
    if schedule == "gpipe":
        return [m]
    v = v or STAGES_PER_RANK[schedule]
    if v == 1:
        return [min(m, p - rank)]
    per_round = m // max(1, m // p)
    chunks = round(held_by_rank(schedule, p, m, rank, v) * v)
    counts = [0] * v
    for k in range(chunks):
        counts[(k // per_round) % v] += 1
    return [min(c, m) for c in counts]


def held_by_rank(schedule: str, p: int, m: int, rank: int, v: int | None = None) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak (module docstring's
    table), in units of all the rank's layers: a looped schedule's stage chunk is ``1/v`` of one."""
    if p <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    v = v or STAGES_PER_RANK[schedule]
    if v == 1:
        return float(min(m, p - rank))
    per_round = m // max(1, m // p)
    chunks = min(m * v, (v - 1) * per_round + WARMUP_PER_HOP[schedule] * (p - 1 - rank) + 1)
    return chunks / v

"""The planner's micro-batches in flight (accelrun/plan/pipeline.py) against torch's own schedules: each
rank's action list, as ``torch.distributed.pipelining`` computes it for the looped schedules, replayed to
count the stage chunks whose activations are alive at once; Schedule1F1B's warm-up rule for 1F1B."""

from __future__ import annotations

import types

import pytest
from torch.distributed.pipelining import schedules

from accelrun.plan.pipeline import held_by_rank, in_flight

LOOPED = {"interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
          "zero_bubble": schedules.ScheduleInterleavedZeroBubble}
# What frees a chunk's activations: its backward (zero bubble: the input-gradient half).
FREES = {"interleaved_1f1b": "FULL_BACKWARD", "zero_bubble": "BACKWARD_INPUT"}


def replayed_peak(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """The most chunks alive on ``rank`` in torch's action list, in units of all the rank's layers."""
    cls = LOOPED[schedule]
    # The rank's action list depends only on these attributes (what the schedule's __init__ sets from its
    # stages), so no process group or stage is built; a private method, hence only in a test.
    rounds = max(1, m // p)
    fake = types.SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m, number_of_rounds=rounds,
                                 microbatches_per_round=m // rounds)
    alive = peak = 0
    for action in cls._calculate_single_rank_operations(fake, rank):
        if action is None:
            continue
        kind = action.computation_type.name
        alive += 1 if kind == "FORWARD" else -1 if kind == FREES[schedule] else 0
        peak = max(peak, alive)
    assert peak > 0  # the replay saw forwards
    return peak / v


@pytest.mark.parametrize("schedule", list(LOOPED))
@pytest.mark.parametrize("p,m,v", [(8, 8, 2), (8, 32, 2), (8, 16, 4), (16, 16, 4), (2, 2, 4), (4, 8, 2), (2, 4, 2)])
def test_looped_schedules_hold_what_torch_runs(schedule, p, m, v):
    for rank in range(p):
        assert held_by_rank(schedule, p, m, rank, v) == replayed_peak(schedule, p, m, v, rank), (p, m, v, rank)


def test_one_stage_schedules():
    assert [held_by_rank("1f1b", 8, 32, r) for r in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert [held_by_rank("1f1b", 8, 4, r) for r in range(8)] == [4, 4, 4, 4, 4, 3, 2, 1]
    assert held_by_rank("gpipe", 4, 8, 3) == 8 and in_flight("1f1b", 4, 2) == 2


def test_interleaving_holds_megatrons_figure_for_many_micro_batches_and_all_of_few():
    # Megatron-LM's p + (p - 1) / v on the first rank once the micro-batches outnumber the warm-up...
    assert in_flight("interleaved_1f1b", 8, 32, 2) == pytest.approx(8 + 7 / 2)
    # ...but never more than the flush's micro-batches: with m = p every forward runs before a backward.
    assert in_flight("interleaved_1f1b", 8, 8, 2) == 8
    # The last rank warms up v - 1 rounds before its first backward, unlike 1F1B's last rank (one).
    assert held_by_rank("interleaved_1f1b", 16, 16, 15, 4) == pytest.approx((3 * 16 + 1) / 4)

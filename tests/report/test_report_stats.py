"""Bootstrap intervals on a ratio of medians: coverage of a known ratio, false alarms on no difference."""

from __future__ import annotations

import math
import random

import pytest

from accelrun.report.stats import (
    CONFIDENCE,
    RatioCI,
    bootstrap_ratio_of_medians,
    median,
    quantile,
    repeats_to_resolve,
)

TRIALS = 200
STEPS = 30
RESAMPLES = 1000  # enough for a 95% interval; keeps 200 trials to a few seconds


def step_times(rng: random.Random, n: int, median_s: float, spread: float = 0.1) -> list[float]:
    """Log-normal step times around ``median_s``, with an occasional slow step (GC, a neighbour)."""
    return [median_s * math.exp(rng.gauss(0, spread)) * (1.6 if rng.random() < 0.05 else 1.0) for _ in range(n)]


def test_median_and_quantile():
    assert median([3, 1, 2]) == 2 and median([4, 1, 3, 2]) == 2.5
    assert quantile([0, 10], 0.25) == 2.5 and quantile([1, 2, 3], 1.0) == 3
    with pytest.raises(ValueError):
        median([])


def test_interval_covers_a_known_ratio():
    # B's steps take 1/1.25 of A's: B is 1.25x faster. Over many seeded samples the 95% interval must
    # contain 1.25 about 95% of the time, and always call the difference significant.
    covered = significant = 0
    for trial in range(TRIALS):
        rng = random.Random(1_000 + trial)
        a, b = step_times(rng, STEPS, 0.100), step_times(rng, STEPS, 0.080)
        ci = bootstrap_ratio_of_medians([a], [b], resamples=RESAMPLES, seed=trial)
        covered += ci.low <= 1.25 <= ci.high
        significant += ci.significant and ci.ratio > 1
    assert covered / TRIALS >= 0.90, covered
    assert significant == TRIALS


def test_no_false_significance_above_the_stated_rate_on_identical_distributions():
    false = 0
    for trial in range(TRIALS):
        rng = random.Random(trial)
        a, b = step_times(rng, STEPS, 0.1), step_times(rng, STEPS, 0.1)
        false += bootstrap_ratio_of_medians([a], [b], resamples=RESAMPLES, seed=trial).significant
    assert false / TRIALS <= 1 - CONFIDENCE, false


def test_repeats_are_resampled_as_runs_so_a_process_effect_widens_the_interval():
    # Three runs per side whose levels differ by a few percent (process-to-process effects): pooling
    # the steps would give a narrow interval; the two-stage bootstrap counts the runs as the noise.
    rng = random.Random(7)
    a = [step_times(rng, STEPS, 0.1 * level, spread=0.02) for level in (0.96, 1.0, 1.04)]
    b = [step_times(rng, STEPS, 0.1 * level, spread=0.02) for level in (1.03, 0.97, 1.0)]
    grouped = bootstrap_ratio_of_medians(a, b, resamples=RESAMPLES)
    pooled = bootstrap_ratio_of_medians([sum(a, [])], [sum(b, [])], resamples=RESAMPLES)
    assert grouped.runs == (3, 3) and pooled.runs == (1, 1)
    assert grouped.ratio == pytest.approx(pooled.ratio)
    assert (grouped.high - grouped.low) > 1.5 * (pooled.high - pooled.low)
    assert not grouped.significant


def test_seeded_and_deterministic():
    rng = random.Random(3)
    a, b = step_times(rng, 15, 0.1), step_times(rng, 15, 0.09)
    first = bootstrap_ratio_of_medians([a], [b], seed=5)
    assert first == bootstrap_ratio_of_medians([a], [b], seed=5)
    assert first != bootstrap_ratio_of_medians([a], [b], seed=6)
    assert first.low <= first.ratio <= first.high


def test_inverted_and_scaled():
    rng = random.Random(4)
    ci = bootstrap_ratio_of_medians([step_times(rng, 20, 0.1)], [step_times(rng, 20, 0.05)])
    inv = ci.inverted()
    assert inv.ratio == pytest.approx(1 / ci.ratio) and inv.low == pytest.approx(1 / ci.high)
    assert ci.scaled(2).low == pytest.approx(2 * ci.low) and ci.scaled(2).significant


def test_bad_samples_are_rejected():
    with pytest.raises(ValueError, match="no samples"):
        bootstrap_ratio_of_medians([[]], [[1.0]])
    with pytest.raises(ValueError, match="positive"):
        bootstrap_ratio_of_medians([[1.0, -1.0]], [[1.0]])


def test_repeats_to_resolve_scales_with_the_square_of_the_precision():
    rng = random.Random(11)
    a = [step_times(rng, 10, 0.1, spread=0.2) for _ in range(2)]
    b = [step_times(rng, 10, 0.1, spread=0.2) for _ in range(2)]
    ci = bootstrap_ratio_of_medians(a, b, resamples=RESAMPLES)
    assert not ci.significant
    hint = repeats_to_resolve(ci, repeats=2)
    assert 1 <= hint.more_repeats <= 6  # never more than 3x the repeats already run
    # With that many runs the half-width, shrinking like 1/sqrt(runs), would reach the target.
    assert ci.half_width_log * math.sqrt(2 / (2 + hint.more_repeats)) <= math.log1p(hint.resolvable) + 1e-9
    assert 0 < hint.resolvable < 1
    # The target is the difference seen where that is at least half the half-width, else that half.
    wide, narrow = RatioCI(1.02, 0.62, 1.68, 0.95, 1, (3, 3)), RatioCI(1.04, 0.99, 1.09, 0.95, 1, (3, 3))
    assert not repeats_to_resolve(wide, 3).seen
    assert repeats_to_resolve(narrow, 3).seen and math.isclose(repeats_to_resolve(narrow, 3).resolvable, 0.04)


def test_paired_rounds_cancel_a_machine_that_changes_speed_between_rounds():
    # ab's rounds: A1 B1, A2 B2, A3 B3 ran side by side. The machine is 30% slower in round 2 and 20%
    # faster in round 3, for both; B is truly 1.10x faster. Resampling rounds as pairs keeps the
    # slowdown on both sides of the ratio; resampling each side's runs independently cannot.
    rng = random.Random(5)
    rounds = (1.0, 1.3, 0.8)
    a = [step_times(rng, STEPS, 0.1 * r, spread=0.03) for r in rounds]
    b = [step_times(rng, STEPS, 0.1 / 1.1 * r, spread=0.03) for r in rounds]
    paired = bootstrap_ratio_of_medians(a, b, resamples=RESAMPLES, paired=True)
    independent = bootstrap_ratio_of_medians(a, b, resamples=RESAMPLES)
    assert paired.significant and paired.low <= 1.1 <= paired.high
    assert not independent.significant
    with pytest.raises(ValueError, match="as many runs"):
        bootstrap_ratio_of_medians(a, b[:2], paired=True)


def test_paired_rounds_keep_the_false_alarm_rate():
    false = 0
    for trial in range(TRIALS // 2):
        rng = random.Random(50_000 + trial)
        rounds = [math.exp(rng.gauss(0, 0.2)) for _ in range(3)]
        a = [step_times(rng, 10, 0.1 * r) for r in rounds]
        b = [step_times(rng, 10, 0.1 * r) for r in rounds]
        false += bootstrap_ratio_of_medians(a, b, resamples=500, seed=trial, paired=True).significant
    assert false / (TRIALS // 2) <= 1 - CONFIDENCE, false

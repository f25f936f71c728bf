"""Statistics for speed comparisons: bootstrap confidence intervals on a ratio of medians.

Step times are skewed and spiky (a page fault, a GC pause, another process), so the figure
compared is the median, and its uncertainty comes from resampling, not from a normal model.

Samples arrive grouped by run: ``[[steady step times of run 1], [run 2], ...]``. With one run per
side the bootstrap resamples steps. With several runs (``accelrun ab --repeats``) it resamples in
two stages, runs first and then steps within each drawn run, so that a difference between
processes (memory layout, thread placement, a busy neighbour) counts as noise, which it is, and
not as a difference between settings. Pooling the steps instead would call a 1% process-to-process
wobble "significant" about one time in eight. Runs that ran side by side (``ab``'s rounds: A1 B1,
A2 B2, ...) are resampled as pairs, so a round in which the whole machine was slower slows both
sides of the ratio instead of widening the interval.

Everything is seeded: the same samples give the same interval on every machine.

Example::

    ci = bootstrap_ratio_of_medians([times_a], [times_b], seed=0)   # median(a) / median(b)
    ci.ratio, ci.low, ci.high, ci.significant                         # 1.23, 1.19, 1.27, True
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95
RESAMPLES = 2000


def median(values: Sequence[float]) -> float:
    """The median (mean of the two middle values for an even count)."""
    if not values:
        raise ValueError("median of no values")
    s = sorted(values)
    h = len(s) // 2
    return s[h] if len(s) % 2 else (s[h - 1] + s[h]) / 2


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0–1) of already sorted values, linearly interpolated.

    Interpolating matters: taking the nearest order statistic narrows a 2,000-resample interval
    enough to push the false-positive rate above the stated 5%.
    """
    if not sorted_values:
        raise ValueError("quantile of no values")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class RatioCI:
    """``ratio`` = median(numerator) / median(denominator), with a bootstrap interval."""

    ratio: float
    low: float
    high: float
    confidence: float
    resamples: int
    runs: tuple[int, int]  # runs on each side (numerator, denominator)

    @property
    def significant(self) -> bool:
        """The interval excludes 1: the medians differ at the stated confidence."""
        return not (self.low <= 1.0 <= self.high)

    @property
    def half_width_log(self) -> float:
        """Half the interval's width on a log scale (≈ the relative uncertainty)."""
        return (math.log(self.high) - math.log(self.low)) / 2

    def inverted(self) -> RatioCI:
        """The same interval for denominator / numerator."""
        return RatioCI(1 / self.ratio, 1 / self.high, 1 / self.low, self.confidence, self.resamples,
                       (self.runs[1], self.runs[0]))

    def scaled(self, factor: float) -> RatioCI:
        """The interval for ``factor`` × the ratio (a constant, such as a ratio of tokens per step)."""
        return RatioCI(self.ratio * factor, self.low * factor, self.high * factor, self.confidence,
                       self.resamples, self.runs)

    def to_dict(self) -> dict:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "confidence": self.confidence,
                "resamples": self.resamples, "runs": list(self.runs), "significant": self.significant}


def _check_groups(groups: Sequence[Sequence[float]], side: str) -> list[list[float]]:
    runs = [list(map(float, g)) for g in groups if len(g)]
    if not runs:
        raise ValueError(f"no samples for the {side}")
    if any(x <= 0 or not math.isfinite(x) for r in runs for x in r):
        raise ValueError(f"the {side}'s samples must be positive and finite")
    return runs


def _resampled_median(runs: list[list[float]], picks: list[int], rng: random.Random) -> float:
    if len(runs) == 1:
        (only,) = runs
        return median(rng.choices(only, k=len(only)))
    drawn: list[float] = []
    for i in picks:  # stage 1 chose the runs
        drawn += rng.choices(runs[i], k=len(runs[i]))  # stage 2: which steps of each
    return median(drawn)


def bootstrap_ratio_of_medians(
    numerator: Sequence[Sequence[float]],
    denominator: Sequence[Sequence[float]],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
    paired: bool = False,
) -> RatioCI:
    """Percentile-bootstrap interval for median(numerator) / median(denominator).

    Each side is a list of runs, each run a list of positive samples (steady step times). The
    point estimate is the ratio of the pooled medians. ``seed`` makes the interval reproducible.
    ``paired``: run i of one side ran next to run i of the other (``ab``'s interleaved rounds), so
    rounds are resampled together and a machine that is slower in one round than in another slows
    both sides of the ratio alike instead of widening the interval.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    num, den = _check_groups(numerator, "numerator"), _check_groups(denominator, "denominator")
    if paired and len(num) != len(den):
        raise ValueError(f"paired samples need as many runs on each side, got {len(num)} and {len(den)}")
    ratio = median([x for r in num for x in r]) / median([x for r in den for x in r])
    rng = random.Random(seed)

    def one() -> float:
        picks_num = rng.choices(range(len(num)), k=len(num))
        picks_den = picks_num if paired else rng.choices(range(len(den)), k=len(den))
        return _resampled_median(num, picks_num, rng) / _resampled_median(den, picks_den, rng)

    ratios = sorted(one() for _ in range(resamples))
    tail = (1 - confidence) / 2
    return RatioCI(ratio, quantile(ratios, tail), quantile(ratios, 1 - tail), confidence, resamples,
                   (len(num), len(den)))


@dataclass(frozen=True)
class ResolveHint:
    """How many more repeats would shrink the interval to resolve ``resolvable`` (a fraction): the
    difference seen (``seen``), or where that is too small to chase, half the interval's present width."""

    more_repeats: int
    resolvable: float
    seen: bool = True


def repeats_to_resolve(ci: RatioCI, repeats: int) -> ResolveHint:
    """Estimate the extra repeats after which a difference like the one seen would be resolved.

    The interval's half-width shrinks like 1/√repeats. The target is the difference observed, but
    no smaller than half the present half-width (beyond that the answer is "many more", and a
    difference that small rarely matters), so the hint never asks for more than three times the
    repeats already run, on top of them.
    """
    repeats = max(repeats, 1)
    h = ci.half_width_log
    target = max(abs(math.log(ci.ratio)), h / 2)
    if target <= 0:  # a degenerate interval: nothing more to learn
        return ResolveHint(0, 0.0)
    needed = math.ceil(repeats * (h / target) ** 2 - 1e-9)
    return ResolveHint(max(needed - repeats, 1), math.exp(target) - 1, seen=target == abs(math.log(ci.ratio)))

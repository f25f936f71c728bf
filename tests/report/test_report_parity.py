"""Loss parity between two loss curves: identical, within tolerance, or the step where they part."""

from __future__ import annotations

import math

from accelrun.report.parity import default_rtol, loss_parity


def curve(values):
    return {i + 1: v for i, v in enumerate(values)}


def test_identical_agree_and_differ():
    ref = curve([5.0, 4.0, 3.0, 2.5])
    assert loss_parity(ref, dict(ref), rtol=1e-3).status == "identical"
    close = curve([5.0, 4.0001, 3.0002, 2.5001])
    p = loss_parity(ref, close, rtol=1e-3)
    assert p.status == "agree" and p.agrees and 0 < p.max_rel_diff < 1e-3
    apart = curve([5.0, 4.0, 3.1, 2.0])
    p = loss_parity(ref, apart, rtol=1e-3)
    assert p.status == "differ" and not p.agrees and p.first_step == 3 and p.values == (3.0, 3.1)
    assert "B parts from A at step 3 (3 vs 3.1)" == p.describe("A", "B")


def test_only_common_steps_are_compared():
    ref = curve([5.0, 4.0, 3.0])
    longer = curve([5.0, 4.0, 3.0, 2.0, 1.0])
    p = loss_parity(ref, longer, rtol=1e-6)
    assert p.status == "identical" and p.steps_compared == 3 and "2 step(s)" in p.length_note
    assert loss_parity(ref, {10: 1.0}, rtol=1e-3).status == "no-common-steps"


def test_non_finite_losses():
    assert loss_parity(curve([5.0, math.nan]), curve([5.0, math.nan]), rtol=1e-3).status == "identical"
    p = loss_parity(curve([5.0, 4.0]), curve([5.0, math.inf]), rtol=1e-3)
    assert p.status == "differ" and p.first_step == 2


def test_tolerance_follows_precision():
    assert default_rtol(["fp32", "fp32"]) == 1e-3
    assert default_rtol(["fp32", "bf16-mixed"]) == 2e-2


def test_curves_that_agree_to_rounding_and_part_late_drift():
    """The default recipe, eager vs accelrun (2026-11-27): ~1e-7 until step 25, then the end of the
    warm-up's loss spike grows it to 1.1e-3 by step 35. That is drift (agrees), not a difference."""
    ref = curve([6.0 - 0.1 * i for i in range(40)])
    late = {s: v * (1 + (2e-7 if s < 30 else 1.5e-3)) for s, v in ref.items()}
    p = loss_parity(ref, late, rtol=1e-3)
    assert p.status == "drift" and p.agrees and p.first_step == 30 and p.early_max < 1e-6
    assert "drift apart as training amplifies rounding" in p.describe("A", "B")
    # Parting as late, but with first steps off by more than rounding (another seed, a wrong gradient):
    # a difference.
    off_early = {s: v * (1 + (5e-5 if s < 30 else 1.5e-3)) for s, v in ref.items()}
    assert loss_parity(ref, off_early, rtol=1e-3).status == "differ"
    # Agreeing to rounding at first but parting within DRIFT_MIN_STEPS: a difference.
    soon = {s: v * (1 + (2e-7 if s < 12 else 1.5e-3)) for s, v in ref.items()}
    assert loss_parity(ref, soon, rtol=1e-3).status == "differ"

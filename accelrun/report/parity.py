"""Loss parity: do two runs still compute the same thing?

With the same data and seed, a change that only makes training faster (a compiler, a kernel,
a parallel layout) should leave the loss curve where it was: bit for bit in fp32 on a CPU with the
same kernels, within rounding when fusion reorders floating-point sums. Runs agree when every step
both recorded is within ``rtol`` (relative) of the reference; otherwise the first step where they part
is reported; curves that agree to rounding early and part only late, as training amplifies rounding,
"drift" (which agrees; see EARLY_STEPS).

Example::

    p = loss_parity(run_a.losses(), run_b.losses(), rtol=default_rtol(["fp32"]))
    p.agrees, p.describe("A", "B")        # False, "B parts from A at step 3 (5.1234 vs 5.2012)"
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Relative tolerance on the loss, by precision. fp32: fusion reorders sums and the difference grows
# slowly with the steps (eager vs inductor on the default recipe: 1e-5 after 30 CPU steps); a changed
# seed or data order moves the loss by about 3e-2 within two steps. bf16 rounds to 8 mantissa bits.
RTOL = {"fp32": 1e-3, "bf16-mixed": 2e-2}

# Training amplifies rounding: two fp32 runs whose kernels sum in another order agree to ~1e-7 for
# dozens of steps, then a loss spike (the end of the learning-rate warm-up) can grow that to 1e-3
# within a few steps (the default recipe, eager vs accelrun, 2026-11-27: 2.5e-7 up to step 25, 1.1e-3
# at step 35). A changed seed or data order, or a wrong gradient, shows in the first steps instead.
# So curves that part late are "drift", which agrees, when the first EARLY_STEPS steps agree to
# rounding (EARLY_RTOL_FRACTION of the tolerance) and at least DRIFT_MIN_STEPS steps agreed before
# they parted.
EARLY_STEPS = 10
EARLY_RTOL_FRACTION = 1e-2
DRIFT_MIN_STEPS = 20


def default_rtol(precisions: list[str]) -> float:
    """The loosest tolerance among the runs' ``train.precision`` values (unknown: the bf16 one)."""
    return max(RTOL.get(p, RTOL["bf16-mixed"]) for p in precisions) if precisions else RTOL["fp32"]


@dataclass(frozen=True)
class LossParity:
    status: str  # identical | agree | drift | differ | no-common-steps
    steps_compared: int
    rtol: float
    max_rel_diff: float | None = None
    first_step: int | None = None  # where they part (status "differ")
    values: tuple[float, float] | None = None  # (reference, other) at first_step
    length_note: str = ""  # when one run has steps the other lacks
    early_max: float | None = None  # largest relative difference over the first EARLY_STEPS common steps

    @property
    def agrees(self) -> bool:
        return self.status in ("identical", "agree", "drift")

    def describe(self, ref: str = "the first run", other: str = "this run") -> str:
        tail = f"; {self.length_note}" if self.length_note else ""
        if self.status == "identical":
            return f"identical over {self.steps_compared} steps{tail}"
        if self.status == "agree":
            return (f"agree within {self.rtol:g} over {self.steps_compared} steps "
                    f"(largest relative difference {self.max_rel_diff:.2g}){tail}")
        if self.status == "drift":
            a, b = self.values or (math.nan, math.nan)
            return (f"agree to {self.early_max:.2g} over the first {EARLY_STEPS} steps and within {self.rtol:g} up "
                    f"to step {(self.first_step or 1) - 1}; from step {self.first_step} ({a:.6g} vs {b:.6g}) "
                    f"they drift apart as training amplifies rounding (largest relative difference "
                    f"{self.max_rel_diff:.2g}){tail}")
        if self.status == "differ":
            a, b = self.values or (math.nan, math.nan)
            return f"{other} parts from {ref} at step {self.first_step} ({a:.6g} vs {b:.6g}){tail}"
        return "no steps in common to compare"

    def to_dict(self) -> dict:
        return {"status": self.status, "steps_compared": self.steps_compared, "rtol": self.rtol,
                "max_rel_diff": self.max_rel_diff, "first_step": self.first_step,
                "values": list(self.values) if self.values else None, "length_note": self.length_note}


def _rel(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def loss_parity(reference: dict[int, float], other: dict[int, float], *, rtol: float) -> LossParity:
    """Compare two ``{step: loss}`` curves on the steps both have."""
    common = sorted(set(reference) & set(other))
    only = len(set(reference) ^ set(other))
    note = f"{only} step(s) recorded by only one run were not compared" if only else ""
    if not common:
        return LossParity("no-common-steps", 0, rtol, length_note=note)
    diffs = [_rel(reference[step], other[step]) for step in common]
    early = max(diffs[:EARLY_STEPS])
    parted = next((i for i, d in enumerate(diffs) if d > rtol), None)
    if parted is None:
        worst = max(diffs)
        return LossParity("identical" if worst == 0.0 else "agree", len(common), rtol, worst, length_note=note,
                          early_max=early)  # fmt: skip
    step = common[parted]
    drift = (parted >= DRIFT_MIN_STEPS and len(common) >= EARLY_STEPS and early <= rtol * EARLY_RTOL_FRACTION
             and all(math.isfinite(d) for d in diffs))  # fmt: skip
    return LossParity("drift" if drift else "differ", len(common), rtol, max(diffs), step,
                      (reference[step], other[step]), note, early)

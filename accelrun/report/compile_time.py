"""How long a run spent compiling, from what the compiler timed rather than from noisy steps alone.

The first step minus the median of the others is all a run without accelrun's compile record has (Inductor:
Dynamo and its backend compile lazily inside the first step). On a busy machine that difference can be
negative: a cold run said "compile time 0.0" while its own stage rows summed to 1.5 s. accelrun's record
times its stages (and, through the graph cache, Dynamo's tracing too), so that figure is a floor the
step difference cannot go under.

Example::

    took = compile_time(metrics, recorded_s=record_seconds(report["compiler"]))
    print(took.seconds, took.how)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accelrun.report.summary import compile_time_s


@dataclass(frozen=True)
class CompileTime:
    seconds: float | None
    how: str  # where the figure comes from, for the report's notes


def record_seconds(compiler: dict[str, Any] | None) -> float | None:
    """The compiler's own timers: the compile section's stage seconds, summed (None without any)."""
    stages = (compiler or {}).get("stage_seconds") or {}
    total = sum(float(v) for v in stages.values())
    return total if total > 0 else None


def compile_time(metrics: list[dict], recorded_s: float | None) -> CompileTime:
    """The larger of the compiler's timers and the first compiling step minus the median other step."""
    from_steps = compile_time_s(metrics)
    if recorded_s is None:
        return CompileTime(from_steps, "compile time = the first step's time minus the median of the others "
                                       "(Dynamo and its backend compile lazily inside the first step)")
    if from_steps is not None and from_steps > recorded_s:
        return CompileTime(from_steps, f"compile time = the first step's time minus the median of the others "
                                       f"({from_steps:.2f} s), above the compiler's own stage timers "
                                       f"({recorded_s:.2f} s), which leave out the first step's other first-time costs "
                                       "(and Dynamo's tracing outside the graph cache)")
    steps = "n/a" if from_steps is None else f"{from_steps:.2f} s"
    return CompileTime(recorded_s, f"compile time = the compiler's own stage timers, summed ({recorded_s:.2f} s); "
                                   f"the first step minus the median of the others said {steps}")

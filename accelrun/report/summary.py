"""From per-step metrics to ``report.json``: steady-state figures, with warm-up and compile kept apart.

Steady state means every step after the first ``warmup_steps`` steps of this run that did not include
compilation and was not profiled (``report.profile_steps``). Figures that need steady steps are null
when there are none, and a line in ``notes`` says why; nothing here raises on a short or odd run.

Example::

    report = summarize(read_metrics(run_dir / "metrics.jsonl"), warmup_steps=3, peak=peak,
                       flops_per_token=6 * n_params, compile_time_s=12.5, tokens_per_step=4096)
    write_json(report, run_dir / "report.json")          # accelrun.report.files
"""

from __future__ import annotations

import math
import statistics

from accelrun.models.flop_count import COUNTED
from accelrun.report.peak import BUSY_PEAK, Peak
from accelrun.report.router import MOE_MFU_NOTE, router_summary

# Fewer steady steps than this still gives figures, with a note that they are noisy.
MIN_STEADY_STEPS = 5
# final_loss_mean averages this many last steps (or all of them in a shorter run).
FINAL_LOSS_WINDOW = 10
# Points kept in the report's loss curve.
LOSS_CURVE_POINTS = 16
# What ``comm_s`` in metrics.jsonl measures (accelrun.dist.comm_timing), as reports label it.
COMM_LABEL = "communication (blocking, measured on rank 0)"
COMM_NOTE = (
    "communication = time rank 0 spent blocked waiting for collectives it or the libraries issued "
    "(torch.distributed waits and DTensor's functional-collective waits, called from Python: loss and "
    "gradient-norm reductions, FSDP all-gathers and reduce-scatters, tensor-parallel redistributions, "
    "pipeline sends and receives), including time waiting for slower ranks; communication overlapped with "
    "compute, collectives inside compiled graphs and other ranks' waits are not counted. It is inside the "
    "step-time parts, not one of them"
)


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of already sorted values, linearly interpolated."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(
    metrics: list[dict],
    *,
    warmup_steps: int,
    peak: Peak,
    flops_per_token: float | None,
    compile_time_s: float | None,
    tokens_per_step: int,
    flops_source: str | None = None,
) -> dict:
    """The content of ``report.json`` for one device's ``metrics`` (``metrics.jsonl`` lines, in order).

    Throughput is per device: ``tokens_per_step`` over the steady median step time. TFLOP/s is
    ``flops_per_token`` times that; MFU divides it by ``peak.tflops``; ``flops_source`` says where that
    count came from, or why there is none (``models/flop_count.py``). ``compile_time_s`` is reported
    apart: it is already inside the step times of the steps flagged ``compile``.
    """
    notes: list[str] = []
    no_steady: str | None = None  # why the step-time figures are null: the terminal's summary says it too
    n = len(metrics)
    warm = metrics[:warmup_steps]
    after = metrics[warmup_steps:]
    steady = [m for m in after if is_steady(m)]
    excluded_compile = sum(1 for m in after if m.get("compile"))
    excluded_profiled = sum(1 for m in after if m.get("profiled") and not m.get("compile"))
    excluded = warm + [m for m in after if m.get("compile")]

    times = sorted(float(m["step_time_s"]) for m in steady)
    median = statistics.median(times) if times else None
    if n == 0:
        notes.append("no steps were recorded: every figure is null")
    elif not steady:
        no_steady = (
            f"no steady-state steps: {n} steps, of which the first {min(warmup_steps, n)} are warm-up "
            f"and {excluded_compile} more included compilation ({excluded_profiled} were profiled); "
            "step-time figures are null "
            "(run more steps or lower report.warmup_steps)"
        )
        notes.append(no_steady)
    elif len(steady) < MIN_STEADY_STEPS:
        notes.append(f"only {len(steady)} steady-state steps: step-time figures are noisy")
    if excluded_profiled:
        notes.append(f"{excluded_profiled} profiled step(s) (report.profile_steps) were left out of "
                     "steady-state figures: the profiler slows them; their trace is in profile/")
    if excluded_compile:
        notes.append(f"{excluded_compile} step(s) after warm-up included compilation (recompiles?) "
                     "and were left out of steady-state figures")

    tokens_per_s = tokens_per_step / median if median else None
    counted = [int(m["loss_tokens"]) for m in metrics if m.get("loss_tokens") is not None]
    loss_tokens = sum(counted) / len(counted) if counted else None
    if loss_tokens is not None and loss_tokens < tokens_per_step:  # chat data with data.loss_on: assistant
        notes.append(f"tokens/s counts every token computed ({tokens_per_step:,} per step per device); "
                     f"{loss_tokens:,.0f} of them per step ({loss_tokens / tokens_per_step:.0%}) were in the loss")
    tflops = (flops_per_token * tokens_per_s / 1e12
              if flops_per_token is not None and tokens_per_s is not None else None)
    mfu = tflops / peak.tflops if tflops is not None and peak.tflops else None
    if flops_per_token is None:
        why = f" ({flops_source})" if flops_source else ""
        notes.append(f"no FLOP count per token for this model{why}: TFLOP/s and MFU are null")
    elif flops_source == COUNTED:  # a user's model: say that the FLOPs are a count, and of what
        notes.append(f"{flops_per_token / 1e6:,.2f} MFLOP per token, {flops_source}")
    if peak.tflops is None:
        notes.append(f"peak unknown, MFU is null: {peak.detail}")
    elif peak.source.startswith("measured") and mfu is not None:
        notes.append("MFU on a CPU is the fraction of the best achievable matrix-product rate measured on "
                     "this machine (torch.mm's, or for fp32 oneDNN's where faster, as the compiler may run "
                     "products), not of a datasheet peak")
        if peak.source.startswith(BUSY_PEAK):  # report/peak.py: not cached, this run only
            notes.append("the CPU peak was measured while other processes used the CPU: it understates the "
                         "machine, so MFU is an upper bound (a quiet run measures and caches it)")

    # The peak is below what the run achieved. A cached measured peak is train's to distrust (it deletes
    # it and says so: run._distrust_low_probe); any other is named here.
    if mfu is not None and mfu > 1 and not peak.cache_file:
        notes.append(f"MFU is {mfu:.0%}: this run's {tflops:.3g} TFLOP/s exceed the peak it is measured against "
                     f"({peak.tflops:.3g} TFLOP/s, {peak.source}), so that peak is too low for this run "
                     "(declare report.peak_tflops)")

    steady_step_s = sum(float(m["step_time_s"]) for m in steady)
    steady_data_s = sum(float(m.get("data_time_s") or 0.0) for m in steady)
    mem = [m["mem_peak_bytes"] for m in metrics if m.get("mem_peak_bytes") is not None]
    reserved = [m["mem_reserved_bytes"] for m in metrics if m.get("mem_reserved_bytes") is not None]  # CUDA only
    losses = [float(m["loss"]) for m in metrics if m.get("loss") is not None]
    window = losses[-FINAL_LOSS_WINDOW:]
    comm = comm_summary(steady)
    if router_summary(metrics) is not None:
        notes.append(MOE_MFU_NOTE)
    if comm is not None:
        notes.append(COMM_NOTE)

    return {
        "steps": n,
        "first_step": metrics[0]["step"] if n else None,
        "last_step": metrics[-1]["step"] if n else None,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "final_loss_mean": sum(window) / len(window) if window else None,
        "final_loss_window": len(window),
        "warmup_steps": warmup_steps,
        "steady_steps": len(steady),
        "excluded_compile_steps": excluded_compile,
        "excluded_profiled_steps": excluded_profiled,
        "no_steady_reason": no_steady,
        "step_time_s": {
            "median": median,
            "p10": percentile(times, 10) if times else None,
            "p90": percentile(times, 90) if times else None,
            "mean": steady_step_s / len(steady) if steady else None,
        },
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        # Targets the loss counted, per step on this device (mean over the steps): data.loss_on: assistant
        # leaves the user's and system's tokens out, which tokens_per_step and tokens_per_s still count.
        "loss_tokens_per_step": loss_tokens,
        "flops_per_token": flops_per_token,
        "tflops": tflops,
        "mfu": mfu,
        "peak": peak.to_dict(),
        "mem_peak_bytes": max(mem) if mem else None,
        "mem_reserved_bytes": max(reserved) if reserved else None,
        "compile_time_s": compile_time_s,
        "warmup_time_s": sum(float(m["step_time_s"]) for m in excluded),
        "data_share": steady_data_s / steady_step_s if steady_step_s > 0 else None,
        # The training loop's wall time: compile time is inside the steps that compiled.
        "total_time_s": sum(float(m["step_time_s"]) for m in metrics),
        "loss_curve": _sample_loss_curve(metrics, LOSS_CURVE_POINTS),
        "loss_steps": len(losses),  # the curve samples these
        "comm_time_s": comm,
        "comm_overlap": overlap_summary(steady),
        "cp_comm": cp_comm_summary(steady),
        "router": router_summary(metrics),  # mixture of experts only (accelrun.report.router)
        "notes": notes,
    }


def comm_summary(steady: list[dict]) -> dict | None:
    """Per-step communication time over steady steps (``comm_s``, written by CPU ranks of a job):
    median seconds and the share of the steps' time; None when it was not measured."""
    rows = [(float(m["comm_s"]), float(m["step_time_s"])) for m in steady if m.get("comm_s") is not None]
    if not rows:
        return None
    total_step = sum(step for _, step in rows)
    return {
        "median": statistics.median(comm for comm, _ in rows),
        "share": sum(comm for comm, _ in rows) / total_step if total_step > 0 else None,
        "what": COMM_LABEL,
    }


def cp_comm_summary(steady: list[dict]) -> dict | None:
    """Context parallelism's key/value all-gathers over steady steps (accelrun.dist.context_parallel):
    median calls, bytes received and seconds blocked per step (seconds None where the gathers ran inside
    compiled blocks); None without context parallelism."""
    rows = [m for m in steady if m.get("cp_gathers") is not None]
    if not rows:
        return None
    timed = [float(m["cp_comm_s"]) for m in rows if m.get("cp_comm_s") is not None]
    return {"gathers": statistics.median(float(m["cp_gathers"]) for m in rows),
            "bytes": statistics.median(float(m["cp_bytes"]) for m in rows),
            "seconds": statistics.median(timed) if timed else None}  # None: compiled blocks, not timed


def overlap_summary(steady: list[dict]) -> dict | None:
    """FSDP's (or compiled graphs') collectives over steady steps (accelrun.dist.comm_overlap): median
    exposed and busy seconds per step, and the overlap fraction 1 − Σ exposed / Σ busy."""
    rows = [(float(m["comm_exposed_s"]), float(m["comm_busy_s"])) for m in steady
            if m.get("comm_busy_s") is not None]  # fmt: skip
    busy = sum(b for _, b in rows)
    if not rows or busy <= 0:  # none traced (HSDP without sharding all-reduces, untraced): no row, not "0.0 ms"
        return None
    return {
        "exposed_s": statistics.median(e for e, _ in rows),
        "busy_s": statistics.median(b for _, b in rows),
        "overlap_fraction": 1.0 - sum(e for e, _ in rows) / busy if busy > 0 else None,
        "what": "FSDP collectives on rank 0: exposed = blocked waiting; busy = some collective in flight",
    }


def is_steady(m: dict) -> bool:
    """A step after warm-up counts as steady unless it compiled or ran under the profiler."""
    return not m.get("compile") and not m.get("profiled")


def _sample_loss_curve(metrics: list[dict], points: int) -> list[dict]:
    """Up to ``points`` (step, loss) pairs spread evenly over the run, first and last included."""
    rows = [m for m in metrics if m.get("loss") is not None]
    if len(rows) <= points:
        picked = rows
    else:
        idx = sorted({round(i * (len(rows) - 1) / (points - 1)) for i in range(points)})
        picked = [rows[i] for i in idx]
    return [{"step": m["step"], "loss": float(m["loss"])} for m in picked]


def compile_time_s(metrics: list[dict]) -> float | None:
    """The first compiling step's time minus the median of the steps that did not compile.

    Dynamo and its backend compile lazily inside the first step, so this is the best estimate
    available without instrumenting the compiler.
    """
    compiling = [m for m in metrics if m.get("compile")]
    rest = [float(m["step_time_s"]) for m in metrics if not m.get("compile")]
    if not compiling or not rest:
        return None
    return max(float(compiling[0]["step_time_s"]) - statistics.median(rest), 0.0)


# Parts of a step the training loop times, and their metrics.jsonl keys.
STEP_PARTS = {"data": "data_time_s", "forward": "forward_s", "backward": "backward_s", "optimizer": "optimizer_s"}


# Under pipelining the schedule interleaves micro-batches' forwards and backwards, timed as one (the loop
# puts it all in forward_s): said as one part, not as a forward of 90% and a backward of none (a new user).
PIPELINED_PASSES = "forward and backward (interleaved by the pipeline schedule)"


def step_breakdown(metrics: list[dict], warmup_steps: int, pipelined: bool = False) -> dict[str, float] | None:
    """Median seconds per part of a steady step (warm-up and compiling steps left out)."""
    steady = [m for m in metrics[warmup_steps:] if is_steady(m)]
    if not steady:
        return None
    parts = {part: statistics.median(float(m.get(key) or 0.0) for m in steady) for part, key in STEP_PARTS.items()}
    if pipelined:
        parts = {"data": parts["data"], PIPELINED_PASSES: parts["forward"] + parts["backward"],
                 "optimizer": parts["optimizer"]}
    return parts


def learning_rate_said(metrics: list[dict], lr: float, schedule: str, warmup_steps: int, steps: int) -> str | None:
    """The learning rate a run trained with, from its metrics: first, peak (and its step), last, against
    ``train.optimizer.lr``. A new user's short run never reached the rate asked for (the recipe's
    warm-up was longer than the run), and no figure of the report showed it."""
    rows = [m for m in metrics if m.get("lr") is not None]
    if not rows:
        return None
    top = max(rows, key=lambda m: m["lr"])
    said = (f"{rows[0]['lr']:.3g} → {top['lr']:.3g} (step {top['step']}) → {rows[-1]['lr']:.3g}: "
            f"train.optimizer.lr {lr:g}, {schedule} after {warmup_steps} warm-up steps")
    if warmup_steps > steps:  # (a resumed folder after the warm-up sees only falling rates: not this)
        said += f"; never reached: the warm-up is longer than the run's {steps} steps"
    return said


def steady_over_folders(metrics: list[dict], starts: list[int], warmup_steps: int, key: str) -> list[float]:
    """``key`` of each steady step's row over a run's folders (``rundata.history_metrics``: the rows and
    where each folder's begin), each folder warming up again: what ``runs list``, ``compare`` and a
    resumed folder's whole-run line count."""
    ends = [*starts[1:], len(metrics)]
    return [float(m[key]) for start, end in zip(starts, ends, strict=True)
            for m in metrics[start + warmup_steps:end] if is_steady(m) and m.get(key)]


def whole_run_summary(metrics: list[dict], starts: list[int], warmup_steps: int,
                      job_tokens_per_step: int | None) -> dict:
    """A resumed run's steps over all its folders (``rundata.history_metrics``: the rows and where each
    folder's begin): what ``runs list`` and
    ``compare`` show for it, beside the folder's own figures in its report. A new user's resumed run
    said 27 steps at 323 ms in report.md and 60 steps at 560 ms in ``runs list``, with nothing saying
    the two covered different steps. ``job_tokens_per_step``: the whole job's (global batch × sequence),
    not a device's (a 2-rank run's whole-run tokens read half of what it trained on)."""
    steady = steady_over_folders(metrics, starts, warmup_steps, "step_time_s")
    losses = [m for m in metrics if m.get("loss") is not None]
    return {
        "folders": len(starts),
        "steps": len(metrics),
        "first_step": int(metrics[0]["step"]) if metrics else None,
        "first_loss": losses[0]["loss"] if losses else None,
        "final_loss": losses[-1]["loss"] if losses else None,
        "step_time_median_s": statistics.median(steady) if steady else None,
        "tokens": job_tokens_per_step * len(metrics) if job_tokens_per_step else None,
    }

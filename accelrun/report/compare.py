"""Put runs side by side: speed with confidence intervals, loss parity, config and machine differences.

A *group* is one setting: a single run for ``accelrun compare``, the repeats of one variant for
``accelrun ab``. Every group is measured against the first. Speed is the ratio of median steady
step times (warm-up, compile and profiled steps left out) with a seeded bootstrap interval
(:mod:`accelrun.report.stats`); parity compares each run's loss curve with the first run's
(:mod:`accelrun.report.parity`).

Example::

    c = compare_groups([Group("A", [load_run(a)]), Group("B", [load_run(b)])])
    c.rows[1].speedup.ratio, c.rows[1].parity.agrees, [d.key for d in c.diff], c.warnings
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from accelrun.config.schema import FAMILY_ONLY_KEYS
from accelrun.report.compile_time import record_seconds
from accelrun.report.lineage import crash_error
from accelrun.report.parity import LossParity, default_rtol, loss_parity
from accelrun.report.peak import BUSY_PEAK
from accelrun.report.rundata import RunRecord
from accelrun.report.stats import RESAMPLES, RatioCI, bootstrap_ratio_of_medians, median
from accelrun.report.summary import compile_time_s

# Sections of the config that decide the numbers trained, minus keys that only change where or how fast.
NUMERIC_PREFIXES = ("model.", "data.", "train.")
NOT_NUMERIC = ("train.threads", "train.device")
# The source shown for a key a run's config does not have (a run from an older accelrun).
ABSENT = "(absent)"
# Shown for a key a run has but does not read (a model family's key in a run of a user's own model).
NOT_READ = "(not read: model.custom is set)"
# Repeats of one setting whose median step times differ by more than this earn a warning.
SPREAD_WARNING = 0.10
# Fewer steady steps than this on either side: no interval.
MIN_STEADY_FOR_CI = 2
# Fewer processes than this a row: the interval resamples their steps, and cannot see how much one process's
# speed differs from another's (a trial's identical runs read 1.27x, "a difference the interval sees").
FEW_REPEATS = 3


@dataclass
class Group:
    label: str
    runs: list[RunRecord]
    overrides: list[str] = field(default_factory=list)  # what sets this group apart (ab variants)


@dataclass
class GroupFigures:
    label: str
    runs: int
    status: str
    steady_steps: int
    median_step_s: float | None
    tokens_per_s: float | None
    mfu: float | None
    mem_peak_bytes: int | None
    compile_time_s: float | None
    final_loss: float | None
    # Throughput against the first group: its median step time over this one's, times the ratio of
    # tokens per step when they differ (> 1: faster).
    speedup: RatioCI | None = None
    parity: LossParity | None = None  # this group's runs against the first group's first run
    parity_cause: str = ""  # config keys that change the numbers, when the losses part
    run_spread: float | None = None  # (max / min − 1) of the runs' median step times (repeats only)
    round_ratios: list[float | None] | None = None  # paired runs: the first group's median / this one's, per round
    overrides: list[str] = field(default_factory=list)
    final_val_loss: float | None = None  # eval.every: the first run's last validation loss

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("speedup", "parity")}
        d["speedup"] = self.speedup.to_dict() if self.speedup else None
        d["parity"] = self.parity.to_dict() if self.parity else None
        return d


@dataclass
class DiffRow:
    key: str
    values: list[Any]  # one per group (its first run), in order; None where the run lacks the key
    sources: list[str]  # NOT_READ where ``reads`` is False
    reads: list[bool]  # whether that run's training reads the key (a user's own model reads no family key)


@dataclass
class Comparison:
    groups: list[Group]
    rows: list[GroupFigures]
    diff: list[DiffRow]
    warnings: list[str]
    notes: list[str]
    rtol: float

    @property
    def losses_agree(self) -> bool:
        return all(r.parity is None or r.parity.agrees for r in self.rows)

    @property
    def labels(self) -> list[str]:
        return [g.label for g in self.groups]

    def to_dict(self) -> dict:
        return {
            "groups": [{"label": g.label, "overrides": g.overrides, "runs": [str(r.path) for r in g.runs]}
                       for g in self.groups],
            "rows": [r.to_dict() for r in self.rows],
            "config_diff": [d.__dict__ for d in self.diff],
            "warnings": self.warnings, "notes": self.notes, "loss_rtol": self.rtol,
            "losses_agree": self.losses_agree,
        }


def compare_groups(groups: list[Group], *, rtol: float | None = None, seed: int = 0,
                   resamples: int = RESAMPLES, paired: bool = False) -> Comparison:
    """Measure every group against the first; see the module docstring. ``paired``: run i of every
    group ran in the same round (``ab``), so rounds are resampled together and per-round ratios shown."""
    if len(groups) < 2 or any(not g.runs for g in groups):
        raise ValueError("compare needs at least two groups, each with a run")
    runs = [r for g in groups for r in g.runs]
    precisions = [str(r.config_flat.get("train.precision", "fp32")) for r in runs]
    rtol = default_rtol(precisions) if rtol is None else rtol
    diff = config_diff([g.runs[0] for g in groups])  # repeats of one variant share their config
    notes: list[str] = []
    peak, peak_note = common_peak(runs)
    if peak_note:
        notes.append(peak_note)
    rows = [_figures(g, peak) for g in groups]
    base = groups[0]
    base_times = [r.steady_step_times() for r in base.runs]
    reference = base.runs[0]
    for gi, (g, row) in enumerate(zip(groups, rows, strict=True)):
        times = [r.steady_step_times() for r in g.runs]
        if g is not base:
            row.speedup = _speedup(base_times, times, seed, resamples, notes, g.label, base.label,
                                   paired and len(times) == len(base_times))
            if paired and len(times) == len(base_times):
                row.round_ratios = [median(b) / median(t) if b and t else None
                                    for b, t in zip(base_times, times, strict=True)]
            tokens, base_tokens = g.runs[0].job_tokens_per_step, reference.job_tokens_per_step
            if row.speedup is not None and tokens and base_tokens and tokens != base_tokens:
                row.speedup = row.speedup.scaled(tokens / base_tokens)  # throughput, not steps per second
        parities = [(loss_parity(reference.losses(), r.losses(), rtol=rtol), r) for r in g.runs if r is not reference]
        if parities:
            # The first disagreement, else the closest call.
            parity, run = next(((p, r) for p, r in parities if not p.agrees), None) or max(
                parities, key=lambda pr: pr[0].max_rel_diff or 0.0)
            # Curves that part where their learning rates already differ (train.steps sets the schedule's
            # length) differ by recipe, not by rounding: never "drift".
            lr_parts = _lr_parts(reference, run, parity.first_step) if parity.first_step is not None else ""
            if lr_parts and parity.status == "drift":
                parity = replace(parity, status="differ")
            row.parity = parity
            dropout = _dropout_cause(reference, run, base.label, g.label)
            if not parity.agrees:
                causes = (lr_parts, _numeric_cause(diff, [0, gi]), dropout)
                row.parity_cause = "; ".join(c for c in causes if c)
            elif dropout:  # close, yet not rounding: their masks differ (a new user read "agree" as parity)
                row.parity_cause = dropout.replace("expected: ", "close, but not by rounding alone: ", 1)
    _tokens_note(groups, notes)
    warnings_of_status: list[str] = []
    for r in runs:
        if r.status in ("crashed", "interrupted", "running", "diverged", "continued"):  # its figures are partial
            why = (crash_error(r.path) or "").strip().splitlines()[:1] if r.status == "crashed" else []
            warnings_of_status.append(f"{r.label} {r.status} after {len(r.metrics)} step(s), which its figures "
                                      "cover" + "".join(f" ({w[:200]})" for w in why))
        if len(r.segments) > 1:
            notes.append(f"{r.label} was resumed: its steps are those of its {len(r.segments)} run folders, from "
                         f"{r.segments[0]} on (each warms up again)")
    warnings, env_notes = environment_differences(runs)
    warnings = warnings_of_status + warnings
    for row in rows:
        if row.run_spread is not None and row.run_spread > SPREAD_WARNING:
            tail = ("rounds are compared pair by pair, so only the part that changed the ratio widens the "
                    "interval" if paired else "the interval widens to match")
            warnings.append(f"the repeats of {row.label} differ by up to {100 * row.run_spread:.0f}% in median step "
                            f"time: the machine's speed changed between runs (busy? throttled?); {tail}")
    return Comparison(groups, rows, diff, warnings, notes + env_notes, rtol)


def run_peak(r: RunRecord) -> float | None:
    """The peak TFLOP/s a run's MFU was measured against (its report's)."""
    tflops = (r.figure("peak") or {}).get("tflops")
    return float(tflops) if tflops else None


def common_peak(runs: list[RunRecord]) -> tuple[float | None, str]:
    """(peak, note): for runs whose peaks were probed on the CPU at one precision, the highest any of
    them measured, which every row's MFU is then taken against, with a note when their own differed
    (each run probes its CPU's matmul rate at its start, on the threads it took: a run that started
    beside a busy process measured a lower peak, and its own MFU then read higher for a slower step).
    None where the peaks rightly differ (precisions, devices, a declared peak): each run's own MFU."""
    sources = [str(r.figure("peak").get("source", "")) for r in runs if r.figure("peak")]
    precisions = {str(r.config_flat.get("train.precision", "fp32")) for r in runs}
    if len(precisions) > 1 or not all(s.startswith(("measured", BUSY_PEAK)) for s in sources):
        own = sorted({p for r in runs if (p := run_peak(r)) is not None})
        if len(own) < 2:
            return None, ""
        # a bf16 run 1.76x faster read as the lower MFU beside fp32's (a new user's trial)
        why = "precisions differ" if len(precisions) > 1 else "devices or declared peaks differ"
        return None, (f"MFU is each run's against its own peak ({', '.join(f'{p:.3g}' for p in own)} TFLOP/s: "
                      f"{why}): compare step times and tokens/s, not MFU, across them")
    peaks = [p for r in runs if (p := run_peak(r)) is not None]
    if not peaks:
        return None, ""
    low, high = min(peaks), max(peaks)
    if high <= low * 1.05:
        return high, ""
    return high, (f"MFU is against the highest peak these runs measured, {high:.3g} TFLOP/s, for every row; "
                  f"their own probes measured {low:.3g} to {high:.3g} (fewer threads, or a busy machine at a "
                  "run's start), and each run's own MFU is against its own")


def _figures(g: Group, peak: float | None = None) -> GroupFigures:
    times = [t for r in g.runs for t in r.steady_step_times()]
    med = median(times) if times else None
    tokens = g.runs[0].job_tokens_per_step  # the job's throughput, whatever its rank count
    # Each run's TFLOP/s at the group's pooled median step (its MFU times its own peak, rescaled from
    # its own median step), over the one peak of the comparison: MFU then follows the step times.
    mfus = []
    for r in g.runs:
        own_peak, own_times = run_peak(r), r.steady_step_times()
        if r.mfu is None:
            continue
        if own_peak is None or peak is None or not own_times or not med:
            mfus.append(r.mfu)  # no peak to rescale from (a run without a report yet): its own
            continue
        mfus.append(r.mfu * own_peak * median(own_times) / med / peak)
    mems = [r.mem_peak_bytes for r in g.runs if r.mem_peak_bytes is not None]
    compiles = [c for r in g.runs for c in [_compile_time(r)] if c is not None]
    run_medians = [median(t) for r in g.runs if (t := r.steady_step_times())]
    spread = max(run_medians) / min(run_medians) - 1 if len(run_medians) > 1 else None
    statuses = sorted({r.status for r in g.runs})
    return GroupFigures(
        label=g.label, runs=len(g.runs), status="/".join(statuses), steady_steps=len(times),
        median_step_s=med, tokens_per_s=tokens / med if med and tokens else None,
        mfu=statistics.median(mfus) if mfus else None, mem_peak_bytes=max(mems) if mems else None,
        compile_time_s=statistics.median(compiles) if compiles else None,
        final_loss=g.runs[0].losses()[max(g.runs[0].losses())] if g.runs[0].losses() else None,
        run_spread=spread, overrides=list(g.overrides),
        final_val_loss=next((float(m["val_loss"]) for m in reversed(g.runs[0].metrics)
                             if m.get("val_loss") is not None), None),
    )


def _compile_time(r: RunRecord) -> float | None:
    if r.report is not None:
        # A report written before compile time came from the compiler's timers may say 0.0 on a busy
        # machine (a difference of steps) while its own compile record timed the stages.
        said, timed = r.report.get("compile_time_s"), record_seconds(r.report.get("compiler"))
        return timed if not said and timed else said
    return compile_time_s(r.metrics)


def _speedup(base: list[list[float]], other: list[list[float]], seed: int, resamples: int, notes: list[str],
             label: str, base_label: str, paired: bool) -> RatioCI | None:
    too_few = [lab for lab, t in ((base_label, base), (label, other)) if sum(map(len, t)) < MIN_STEADY_FOR_CI]
    if too_few:
        notes.append(f"{' and '.join(too_few)}: fewer than {MIN_STEADY_FOR_CI} steady steps, so no speed "
                     "interval (run more steps or lower report.warmup_steps)")
        return None
    if any(not t for t in base + other):  # a run without steady steps cannot be paired or resampled
        paired = False
    return bootstrap_ratio_of_medians(base, other, seed=seed, resamples=resamples, paired=paired)


def _tokens_note(groups: list[Group], notes: list[str]) -> None:
    tokens = {g.label: g.runs[0].job_tokens_per_step for g in groups}
    if len(set(tokens.values())) > 1:
        notes.append("tokens per step (the job's) differ (" + ", ".join(f"{k}: {v}" for k, v in tokens.items()) +
                     "): speed ratios compare tokens/s, not steps/s")


def config_diff(runs: list[RunRecord]) -> list[DiffRow]:
    """Every config key whose value is not the same in all the runs that read it, with each run's source
    for it (a user's own model reads few of model.*'s keys: ``NOT_READ`` in its cells)."""
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r.config_flat if k not in keys]
    rows = []
    for k in keys:
        reads = [_reads(r, k) for r in runs]
        values = [r.config_flat.get(k) for r, read in zip(runs, reads, strict=True) if read]
        if all(v in ({}, [], None) for v in values) and any(_has_children(r, k) for r in runs):
            continue  # an empty section beside one with keys ("model.kwargs (absent)" against "{}"): its keys' rows say it
        if any(v != values[0] for v in values[1:]):
            rows.append(DiffRow(k, [r.config_flat.get(k) for r in runs],
                                [NOT_READ if not read else r.sources.get(k, "?") if k in r.config_flat else ABSENT
                                 for r, read in zip(runs, reads, strict=True)], reads))  # fmt: skip
    return rows


def _has_children(run: RunRecord, key: str) -> bool:
    return any(k.startswith(key + ".") for k in run.config_flat)


def _reads(run: RunRecord, key: str) -> bool:
    """Whether ``run``'s training reads ``key``: a user's own model reads no model family's keys."""
    section, _, rest = key.partition(".")
    return not (section == "model" and run.config_flat.get("model.custom") and rest.partition(".")[0] in FAMILY_ONLY_KEYS)


def _lr_parts(reference: RunRecord, other: RunRecord, until: int) -> str:
    """Where the two runs' recorded learning rates first differ, at or before step ``until``, or ""."""
    mine, theirs = reference.learning_rates(), other.learning_rates()
    for step in sorted(set(mine) & set(theirs)):
        if step > until:
            break
        a, b = mine[step], theirs[step]
        if abs(a - b) > 1e-6 * max(abs(a), abs(b)):
            return f"their learning rates differ from step {step} on, {a:.4g} vs {b:.4g}"
    return ""


def _numeric_cause(diff: list[DiffRow], indices: list[int]) -> str:
    """The config keys that change the numbers and differ between the groups at ``indices``."""
    keys = [d.key for d in diff if d.key.startswith(NUMERIC_PREFIXES) and d.key not in NOT_NUMERIC
            and len({repr(d.values[i]) for i in indices if d.reads[i]}) > 1]
    if not keys:
        return ""
    return "expected: " + ", ".join(keys[:4]) + (" and more" if len(keys) > 4 else "") + (
        " differs" if len(keys) == 1 else " differ")


def _dropout_cause(reference: RunRecord, other: RunRecord, reference_label: str, other_label: str) -> str:
    """Of two runs, one drew its dropout masks in accelrun's kernels (its own generator: cpu_dropout,
    attention's kernel) and the other with ATen's: their curves part by their random numbers, not by a
    fault. Named by their groups' labels (B, not its repeat B1)."""
    drew = [label for r, label in ((reference, reference_label), (other, other_label))
            if ((r.report or {}).get("compiler") or {}).get("dropout_in_kernels")]  # fmt: skip
    if len(drew) != 1:
        return ""
    return f"expected: {drew[0]} drew its dropout masks in accelrun's kernels, the other with ATen's"


# (what, path in env.json, severity, the recipe key that sets it): a warning makes a speed comparison
# suspect; a note is context. Where the runs' recipes differ in that key, the difference is what the
# comparison compares (`accelrun ab --a train.cpu_malloc=tuned --b train.cpu_malloc=blocks`): a note.
ENV_CHECKS = (
    ("CPU", ("cpu", "model"), "warning", None),
    ("GPU", ("cuda", "devices"), "warning", None),
    ("torch", ("versions", "torch"), "warning", None),
    ("Python", ("versions", "python"), "warning", None),
    ("triton", ("versions", "triton"), "warning", None),
    ("accelrun", ("versions", "accelrun"), "warning", None),
    ("torch threads", ("cpu", "torch_threads"), "warning", "train.threads"),
    ("host malloc", ("cpu", "malloc"), "warning", "train.cpu_malloc"),
    ("host", ("hostname",), "note", None),
    ("git commit", ("git", "commit"), "note", None),
)


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree.get(k) if isinstance(tree, dict) else None
    return tree


def environment_differences(runs: list[RunRecord]) -> tuple[list[str], list[str]]:
    """(warnings, notes): differences in machine, software or data that make a comparison not like
    for like (warnings), and differences worth knowing that do not (notes)."""
    warnings: list[str] = []
    notes: list[str] = []
    labels = [r.label for r in runs]
    for what, path, severity, set_by in ENV_CHECKS:
        values = [_get(r.env, path) for r in runs]
        if all(v is None for v in values) or len({repr(v) for v in values}) == 1:
            continue
        shown = "; ".join(f"{lab}: {v if v not in (None, []) else 'none'}"
                          for lab, v in zip(labels, values, strict=True))
        if set_by is not None and len({repr(_get(r.config, tuple(set_by.split(".")))) for r in runs}) > 1:
            notes.append(f"different {what}, as {set_by} differs: {shown}")
        elif severity == "warning":
            warnings.append(f"different {what}: {shown} — speed figures are not like for like")
        else:
            notes.append(f"different {what}: {shown}")
    for r in runs:  # a resumed run's folders may have run on another machine, or beside a busy process
        envs = r.segment_envs
        for what, path, severity, _ in ENV_CHECKS:
            values = [_get(env, path) for env in envs]
            if severity == "warning" and len({repr(v) for v in values if v is not None}) > 1:
                warnings.append(f"{r.label}'s {len(envs)} run folders differ in {what} ("
                                + ", ".join(str(v) for v in values) + "): its figures mix them")
    data = [r.figure("data") for r in runs]
    if len({d for d in data if d is not None}) > 1:
        warnings.append("different data (fingerprints " + ", ".join(str(d) for d in data) +
                        "): the losses are not expected to agree")
    devices = [r.figure("device") for r in runs]
    if len({d for d in devices if d is not None}) > 1:
        warnings.append("different devices: " + ", ".join(str(d) for d in devices))
    if differing := model_keys_differing(runs):
        verb = "differs" if len(differing) == 1 else "differ"
        warnings.append(f"different models ({', '.join(differing)} {verb}): the runs do different work, so their "
                        "step times, tokens/s and losses compare models, not settings")
    return warnings, notes


# What makes a model another model (other work per token): its kind and its shape. Not the settings an
# A/B of one model varies (init_std, aux_loss_coef, capacity_factor, rope_theta, max_seq_len, ...).
MODEL_IDENTITY_KEYS = frozenset({
    "custom", "kwargs", "hf", "arch", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
    "vocab_size", "tie_embeddings", "qkv_bias", "n_experts", "experts_per_token", "moe_ffn_dim",
    "shared_expert_ffn_dim"})


def model_keys_differing(runs: list[RunRecord]) -> list[str]:
    """The keys that make a model (``MODEL_IDENTITY_KEYS``) the runs read whose values differ
    (``config_diff``'s; a dict's own key, not each of its entries), found by a new user: ``compare`` of
    two runs of different models printed a speedup with no word on it."""
    # a dict's entries are named by the dict (model.kwargs.p: model.kwargs)
    keys = dict.fromkeys("model." + d.key.split(".")[1] for d in config_diff(runs) if d.key.startswith("model."))
    return [k for k in keys if k.removeprefix("model.") in MODEL_IDENTITY_KEYS]

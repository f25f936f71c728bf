"""``accelrun ab``: run settings as fresh processes, interleaved, and say which is faster and by how much.

Each variant (A, B, ...) is the recipe plus its own ``key=value`` overrides. Every repeat of every
variant is a new ``python -m accelrun.cli.main train`` process, so no variant inherits another's warm
caches, allocator state or compiled graphs, and they run interleaved (A B A B ...) so that a machine
that slows down over time (heat, a neighbour) slows every variant alike. Speed comes from steady steps
only (after ``report.warmup_steps``, not compiling, not profiled), as the ratio of median step times
with a bootstrap interval over repeats and steps (:mod:`accelrun.report.stats`).

The ``ab`` directory holds ``runs/`` (the variants' run directories), ``logs/`` (each process's
output), ``ab.json``, ``ab.md`` and ``ab.html``, and ``command.txt``.

Exit codes (``accelrun ab``): 0 done and the losses agree; 4 done but the losses disagree;
5 a variant's process failed; 2 a user error (bad recipe or override, found before anything runs).
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from accelrun.config import ConfigError, ResolvedConfig, load_config
from accelrun.dist import stop
from accelrun.errors import UserError
from accelrun.report.compare import (
    FEW_REPEATS,
    MIN_STEADY_FOR_CI,
    Comparison,
    Group,
    GroupFigures,
    compare_groups,
)
from accelrun.report.machine_load import BUSY_WARNING, OtherCpuMeter
from accelrun.report.rundata import load_run
from accelrun.report.rundir import list_runs
from accelrun.report.stats import RatioCI, ResolveHint, repeats_to_resolve
from accelrun.train.threads import ThreadChoice, choose_threads

EXIT_LOSSES_DISAGREE = 4
EXIT_INTERRUPTED = stop.exit_code(signal.SIGINT)  # 130, the shell's code for Ctrl-C
EXIT_PREEMPTED = stop.exit_code(signal.SIGTERM)  # 143: a variant's run stopped by either stops ab
LOG_TAIL_LINES = 15


class VariantFailed(UserError):
    """A variant's training process exited with an error; its log is kept."""

    exit_code = 5


@dataclass
class Variant:
    label: str
    overrides: list[str]


@dataclass
class AbPlan:
    config: str
    variants: list[Variant]
    out_dir: Path
    common: list[str] = field(default_factory=list)  # overrides every variant gets
    repeats: int = 3
    steps: int | None = None
    warmup_steps: int | None = None
    notes: list[str] = field(default_factory=list)  # said when the plan is made, kept in the result
    validated: set[str] = field(default_factory=set)  # config hashes `accelrun validate` passed
    pinned_threads: int | None = None  # train.threads ab chose for every variant (a busy neighbour)
    warned: dict[str, list[str]] = field(default_factory=dict)  # each variant's `accelrun validate` warnings

    def forced(self) -> list[str]:
        """Overrides ab imposes last: fresh, checkpoint-free runs in the ab directory, progress as lines.
        No checkpoint means no export at the end either (configs/hf-llama.yaml sets hf_on_finish, which
        needs the final checkpoint: ab refused that recipe)."""
        forced = [f"report.runs_dir={self.out_dir / 'runs'}", "checkpoint.enabled=false", "checkpoint.hf_on_finish=false",
                  "checkpoint.resume=none", "report.progress=lines"]
        if self.steps is not None:
            forced.insert(0, f"train.steps={self.steps}")
        if self.warmup_steps is not None:
            forced.append(f"report.warmup_steps={self.warmup_steps}")
        return forced

    def overrides(self, v: Variant) -> list[str]:
        """The variant's overrides, with those of a key ab sets itself (``forced``, last, which wins) left
        out: the child's command names each key once (it showed the user's report.runs_dir, then ab's)."""
        forced = self.forced()
        taken = {_override_key(o) for o in forced}
        return [*(o for o in [*self.common, *v.overrides] if _override_key(o) not in taken), *forced]

    def command(self, v: Variant) -> list[str]:
        return [sys.executable, "-m", "accelrun.cli.main", "train", self.config, *self.overrides(v)]

    def schedule(self) -> list[tuple[int, Variant]]:
        """(repeat, variant) in the order they run: A B A B ..., one round per repeat."""
        return [(r, v) for r in range(1, self.repeats + 1) for v in self.variants]


def refuse_what_validate_refuses(plan: AbPlan, v: Variant) -> None:
    """``accelrun validate`` of the variant, as its runs will be started (a process of its own: a user's
    model module is imported there, never in this one, which stays beside the timed runs): what it
    refuses beyond the recipe (data files, the processes for this node, a user's model built on the
    meta device) stops ab before any run, exit 2, each line said of its variant (a variant B whose
    ``model.kwargs`` did not fit its factory ran after all of A1: a new user, 2026-12-06). What it
    could not check, and its warnings, go to the plan's notes (``warning_notes``): the runs' own
    console lines go to their logs only."""
    cmd = [sys.executable, "-m", "accelrun.cli.main", "validate", plan.config, *plan.overrides(v)]
    plain = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    done = subprocess.run(cmd, capture_output=True, text=True, env={**plain, "NO_COLOR": "1", "TERM": "dumb"})
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    plan.warned[v.label] = [line.removeprefix("warning: ") for line in said if line.startswith("warning: ")]
    for line in said:
        if line.startswith("note: ") and (note := f"variant {v.label}: {line[6:]}") not in plan.notes:
            plan.notes.append(note)
    if done.returncode == 2:
        errors = [line.removeprefix("error: ") for line in said if line.startswith("error: ")]
        raise ConfigError([f"variant {v.label}: {e}" for e in errors or said[-1:]])
    if done.returncode != 0:
        raise UserError(f"variant {v.label}: `accelrun validate` exited with code {done.returncode}: "
                        + (said[-1] if said else "no output"))


def warning_notes(plan: AbPlan) -> list[str]:
    """The variants' recipe warnings, once each: a warning every variant has is said of all (a warm-up
    longer than ``--steps``, which a trial's ab printed only into its runs' logs)."""
    said = [plan.warned.get(v.label, []) for v in plan.variants]
    common = [w for w in said[0] if all(w in other for other in said[1:])] if said else []
    notes = [f"every variant: {w}" for w in common]
    for v, warnings in zip(plan.variants, said, strict=True):
        notes += [f"variant {v.label}: {w}" for w in warnings if w not in common]
    return notes


def resolve_variants(plan: AbPlan) -> list[ResolvedConfig]:
    """Load and validate every variant before anything runs (a typo costs no training)."""
    resolved = []
    for v in plan.variants:
        try:
            resolved.append(load_config(plan.config, plan.overrides(v)))
        except UserError as e:  # which variant's overrides it concerns (a trial's --b read as the recipe's)
            e.messages = [f"variant {v.label}: {m}" for m in e.messages]
            e.args = ("\n".join(e.messages),)
            raise
    first_with: dict[str, str] = {}
    for v, r in zip(plan.variants, resolved, strict=True):
        if r.hash in first_with:  # an A/A run: how a user measures this machine's noise
            # (no config hash: resolved again once the output folder is set, the hash changes with it)
            note = (f"variant {v.label} resolves to the same config as {first_with[r.hash]}: an A/A run, "
                    "whose speed ratio and interval measure this machine's run-to-run noise")
            if note not in plan.notes:
                plan.notes.append(note)
        first_with.setdefault(r.hash, v.label)
    if len({r.config.train.steps for r in resolved}) > 1:
        raise UserError("the variants train different numbers of steps; give --steps to run them alike")
    for v, r in zip(plan.variants, resolved, strict=True):
        steps, warmup = r.config.train.steps, r.config.report.warmup_steps
        if max(steps - warmup, 0) * plan.repeats < MIN_STEADY_FOR_CI:  # every run trains, then no speed to compare
            raise UserError(f"variant {v.label}: report.warmup_steps = {warmup} of train.steps = {steps} leaves "
                            f"{max(steps - warmup, 0)} steady step(s) a run, {max(steps - warmup, 0) * plan.repeats} "
                            f"over {plan.repeats} repeat(s): a speed needs {MIN_STEADY_FOR_CI}; give --steps "
                            f"{warmup + MIN_STEADY_FOR_CI} or more, or --warmup-steps "
                            f"{max(steps - MIN_STEADY_FOR_CI, 0)} or fewer")
    validated_by: dict[str, str] = {}
    for v, r in zip(plan.variants, resolved, strict=True):  # after the checks above, which cost nothing
        if r.hash not in plan.validated:  # once per config, though ab resolves its variants twice
            plan.validated.add(r.hash)
            refuse_what_validate_refuses(plan, v)
        validated_by.setdefault(r.hash, v.label)
        if v.label not in plan.warned:  # an A/A run's twin warns as the variant validated with its config
            plan.warned[v.label] = plan.warned.get(validated_by[r.hash], [])
    for note in warning_notes(plan):
        if note not in plan.notes:
            plan.notes.append(note)
    if plan.repeats < FEW_REPEATS:
        note = (f"{plan.repeats} repeat(s) of each variant: the interval resamples the steps of too few "
                "processes to cover how much a new process's speed varies on this machine (often several "
                f"percent); --repeats {FEW_REPEATS} or more gives an interval that does")
        if note not in plan.notes:
            plan.notes.append(note)
    return resolved


def _stop(proc: subprocess.Popen) -> None:
    """End a variant's run that ab was interrupted in: Ctrl-C at a terminal reached it too; `kill -INT`
    of ab alone did not. A second SIGINT makes it stop at once; a run that still does not is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class RunEvent:
    """Progress for the caller to show: a run starting, a line of its output, a run done."""

    kind: str  # start | line | done
    index: int  # 1-based position in the schedule
    total: int
    repeat: int
    variant: str
    elapsed_s: float  # since ab started
    text: str = ""  # start: the command's arguments; line: the output line; done: the run directory
    other_cpu: float | None = None  # done: share of the CPU other processes used during the run


def _new_run_dir(runs_root: Path, before: set[Path]) -> Path | None:
    after = set(list_runs(runs_root))
    new = sorted(after - before, key=lambda p: p.name)
    return new[-1] if new else None


def run_one(plan: AbPlan, v: Variant, repeat: int, index: int, total: int, t0: float,
            on_event: Callable[[RunEvent], None]) -> tuple[Path, float | None]:
    """Run one variant once as a fresh process; return its run directory and the share of the CPU
    that other processes used meanwhile."""
    runs_root = plan.out_dir / "runs"
    before = set(list_runs(runs_root))
    log_path = plan.out_dir / "logs" / f"{index:02d}-{v.label}-{repeat}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = plan.command(v)
    on_event(RunEvent("start", index, total, repeat, v.label, time.perf_counter() - t0, shlex.join(cmd[4:])))
    tail: list[str] = []
    meter = OtherCpuMeter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                # Every variant on torch's default threads: a thread count picked per run from
                                # the machine's load (train/threads.py) would make the runs unlike for like.
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "ACCELRUN_FIXED_THREADS": "1"})
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line.rstrip()])[-LOG_TAIL_LINES:]
                if line.startswith("step "):
                    on_event(RunEvent("line", index, total, repeat, v.label, time.perf_counter() - t0, line.rstrip()))
        except KeyboardInterrupt:  # the user stopped ab: stop this run too (it saves nothing: ab turns checkpoints off)
            _stop(proc)
            raise
        code = proc.wait()
    others = meter.share()
    if code in (EXIT_INTERRUPTED, EXIT_PREEMPTED):  # the run was stopped (Ctrl-C reached it, not ab; or SIGTERM)
        raise KeyboardInterrupt
    run_dir = _new_run_dir(runs_root, before)
    if code != 0 or run_dir is None or not (run_dir / "report.json").exists():
        raise VariantFailed([f"variant {v.label}, repeat {repeat}: `accelrun train` exited with code {code}; "
                             f"its output is in {log_path}; the last lines:", *tail])
    on_event(RunEvent("done", index, total, repeat, v.label, time.perf_counter() - t0, str(run_dir), others))
    return run_dir, others


@dataclass
class AbResult:
    plan: AbPlan
    comparison: Comparison
    verdicts: list[str]
    wall_s: float
    other_cpu: dict[str, list[float | None]] = field(default_factory=dict)  # per variant, per repeat
    interrupted_after: int | None = None  # Ctrl-C: the rounds every variant finished, which the figures cover

    @property
    def exit_code(self) -> int:
        if self.interrupted_after is not None:
            return EXIT_INTERRUPTED
        return 0 if self.comparison.losses_agree else EXIT_LOSSES_DISAGREE


def pin_threads_to_free_cores(plan: AbPlan, resolved: list[ResolvedConfig],
                              choose: Callable[[], ThreadChoice] = choose_threads) -> None:
    """Every variant on the threads of the cores nobody else was using when ab started, where a neighbour
    was busy and no recipe or override sets train.threads: the same count for all (like for like, where
    ``accelrun train`` picks per run), and not more than the free cores (on every core beside a busy
    neighbour, a new user's variants swung from 0.3 to 4 s a step and the interval spanned 0.2-5.8x).
    CPU runs of one process only (a GPU's or a multi-process job's threads are another matter);
    ACCELRUN_FIXED_THREADS=1 keeps torch's default, as it does for `accelrun train`."""
    if os.environ.get("ACCELRUN_FIXED_THREADS") == "1":
        return
    if any(r.config.train.threads is not None or r.config.train.device == "cuda" or r.config.parallel.world_size > 1
           for r in resolved):  # fmt: skip
        return
    if any(r.config.train.device == "auto" for r in resolved):
        import torch

        if torch.cuda.is_available():
            return
    choice = choose()
    if choice.threads >= choice.usable_cores:
        return
    plan.common.append(f"train.threads={choice.threads}")
    plan.pinned_threads = choice.threads
    left = ("the cores left" if choice.usable_cores - choice.others_cores >= choice.threads - 0.5
            else "none was free, so one")  # (a trial read "the cores left" where others used all of them)
    plan.notes.append(f"other processes were using {choice.others_cores:.1f} of this machine's {choice.usable_cores} "
                      f"cores when ab started: every variant runs on train.threads={choice.threads}, {left} "
                      "(set train.threads before --a to choose)")


def run_ab(plan: AbPlan, on_event: Callable[[RunEvent], None] = lambda e: None, *, seed: int = 0,
           loss_rtol: float | None = None) -> AbResult:
    """Run the plan's schedule and compare the variants (see the module docstring)."""
    pin_threads_to_free_cores(plan, resolve_variants(plan))
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    done: dict[str, list[Path]] = {v.label: [] for v in plan.variants}
    others: dict[str, list[float | None]] = {v.label: [] for v in plan.variants}
    schedule = plan.schedule()
    try:
        for i, (repeat, v) in enumerate(schedule, start=1):
            run_dir, busy = run_one(plan, v, repeat, i, len(schedule), t0, on_event)
            done[v.label].append(run_dir)
            others[v.label].append(busy)
    except KeyboardInterrupt:
        # Ctrl-C: the rounds every variant finished still compare (paired, as ab's rounds are); none: nothing to say.
        rounds = min(len(runs) for runs in done.values())
        if rounds == 0:
            raise
        plan.notes.append(f"interrupted (Ctrl-C or a stop signal) in round {rounds + 1} of {plan.repeats}: the "
                          f"figures cover the {rounds} round(s) every variant finished")
        result = summarize_ab(plan, {k: runs[:rounds] for k, runs in done.items()}, seed=seed, loss_rtol=loss_rtol,
                              wall_s=time.perf_counter() - t0, other_cpu={k: o[:rounds] for k, o in others.items()})
        result.interrupted_after = rounds
        return result
    return summarize_ab(plan, done, seed=seed, loss_rtol=loss_rtol, wall_s=time.perf_counter() - t0,
                        other_cpu=others)


def compile_warnings(groups: list[Group]) -> list[str]:
    """Each variant's compile warnings (a graph break, a skipped frame), said once a variant: its runs
    printed them, and ab.md had left them out (a new user's trial)."""
    out = []
    for g in groups:
        said = dict.fromkeys(w for run in g.runs for w in ((run.report or {}).get("compiler") or {}).get("warnings", []))
        out += [f"variant {g.label}: {w}" for w in said]
    return out


def summarize_ab(plan: AbPlan, run_dirs: dict[str, list[Path]], *, seed: int = 0, loss_rtol: float | None = None,
                 wall_s: float = 0.0, other_cpu: dict[str, list[float | None]] | None = None) -> AbResult:
    """Compare finished runs (``{variant label: run directories}``) and write the verdicts."""
    groups = []
    for v in plan.variants:
        runs = [load_run(d, label=f"{v.label}{k}") for k, d in enumerate(run_dirs[v.label], start=1)]
        groups.append(Group(v.label, runs, v.overrides))
    c = compare_groups(groups, rtol=loss_rtol, seed=seed, paired=True)  # A_r, B_r, ... ran in round r
    c.notes[:0] = plan.notes
    c.warnings += compile_warnings(groups)
    base = c.rows[0]
    # The rounds that ran (an interrupted ab compares those only): "1.22x faster" of one round, under
    # --repeats 5, is one process's (a review's finding).
    rounds = min(len(run_dirs[v.label]) for v in plan.variants)
    verdicts = [verdict_line(row, base, rounds, multi=len(c.rows) > 2) for row in c.rows[1:]]
    if base.parity is not None and not base.parity.agrees:  # A's own repeats disagree: nondeterminism
        verdicts.append(f"{base.label}'s repeats disagree with each other: "
                        + base.parity.describe(f"{base.label}'s first run", f"a repeat of {base.label}"))
    other_cpu = other_cpu or {}
    busy = {f"{label}{k}": share for label, shares in other_cpu.items()
            for k, share in enumerate(shares, start=1) if share is not None}
    if busy and max(busy.values()) > BUSY_WARNING:
        given = {g.label: g.runs[0].config_flat.get("train.threads") for g in groups}
        if plan.pinned_threads is not None:
            how = f"Every variant ran on train.threads={plan.pinned_threads}, the cores free when ab started"
        elif all(t is None for t in given.values()):
            how = ("The variants ran on torch's default threads (every core), so that they compare like for like, "
                   "where `accelrun train` alone takes fewer threads beside a busy neighbour (train.threads=1 "
                   "before --a compares them that way)")  # fmt: skip
        else:
            how = "The variants ran on train.threads as given: " + ", ".join(
                f"{label} {'every core' if t is None else t}" for label, t in given.items())
        c.warnings.insert(0, "other processes used up to " + _pct(max(busy.values())) + " of the CPU during the "
                          "runs (" + ", ".join(f"{k} {_pct(v)}" for k, v in busy.items()) + "): they competed "
                          "with the variants, so the speed figures are less reliable; run ab on a quiet machine. "
                          + how)
    return AbResult(plan, c, verdicts, wall_s, other_cpu)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x < 0.1 else f"{100 * x:.0f}%"


def _digits(ci: RatioCI) -> int:
    """Decimals for an interval's bounds: a third where two would print a narrow one as "1.00–1.01"."""
    return 2 if ci.high - ci.low >= 0.02 else 3


def _no_difference(ci: RatioCI, label: str, base: str, hint: ResolveHint) -> str:
    """The interval, and what more repeats could buy: showing the difference seen, if it holds, or (an
    interval far wider than that difference) how small a difference would then show at all."""
    d = _digits(ci)
    out = (f"no significant difference: {label} at {ci.ratio:.{d}f}× {base}'s speed "
           f"({100 * ci.confidence:.0f}% CI {ci.low:.{d}f}–{ci.high:.{d}f})")
    if hint.more_repeats == 0:  # a degenerate interval: nothing more to learn
        return out
    more = f"{hint.more_repeats} more repeat{'s' if hint.more_repeats != 1 else ''}"
    if hint.seen:
        return out + f"; about {more} could show its {_pct(abs(ci.ratio - 1))} difference, if it holds"
    return (out + f": differences under {_pct(math.exp(ci.half_width_log) - 1)} do not show at this noise; "
            f"{more} would bring that to about {_pct(hint.resolvable)}, a quieter machine lower still")


def verdict_line(row: GroupFigures, base: GroupFigures, repeats: int, *, multi: bool = False) -> str:
    """``B is 1.23× faster than A (95% CI 1.19–1.27); losses agree``, or no significant difference and
    how many more repeats would resolve one; the losses part says whether they agree."""
    ci = row.speedup
    prefix = f"{row.label} vs {base.label}: " if multi else ""
    if ci is None:
        speed = f"{prefix}too few steady steps to compare speed (run more --steps)"
    elif ci.significant:
        faster = ci.ratio >= 1
        shown = ci if faster else ci.inverted()
        digits = _digits(shown)
        interval = f"{100 * ci.confidence:.0f}% CI {shown.low:.{digits}f}–{shown.high:.{digits}f}"
        if repeats < FEW_REPEATS:
            # The interval resamples the steps of one or two processes, and a new process's pace moves
            # more than that: a trial's "1.22x slower" came back "1.37x faster" for the same graphs.
            speed = (f"{row.label} ran {shown.ratio:.{digits}f}× {'faster' if faster else 'slower'} than "
                     f"{base.label} in {repeats} repeat(s) ({interval} over their steps): too few repeats to call "
                     f"a difference; --repeats {FEW_REPEATS} or more")
        else:
            speed = (f"{row.label} is {shown.ratio:.{digits}f}× {'faster' if faster else 'slower'} than {base.label} "
                     f"({interval})")
    else:
        speed = f"{prefix}{_no_difference(ci, row.label, base.label, repeats_to_resolve(ci, repeats))}"
    if row.parity is not None and row.parity.status == "drift":  # agrees, but say where the curves part
        losses = f"losses agree (to {row.parity.early_max:.1g} at first; drift from step {row.parity.first_step})"
    elif row.parity is None or row.parity.agrees:
        losses = "losses agree"
    else:
        cause = f"; {row.parity_cause}" if row.parity_cause else ""
        losses = f"losses disagree: {row.parity.describe(base.label, row.label)}{cause}"
    return f"{speed}; {losses}"


def write_ab_reports(result: AbResult, command: str = "") -> list[Path]:
    """``ab.json``, ``ab.md`` and ``ab.html`` in the plan's directory (and ``command.txt``)."""
    from accelrun.report.compare_render import render_comparison_html, render_comparison_md
    from accelrun.report.files import write_json, write_text_atomic

    plan, c = result.plan, result.comparison
    title = "accelrun ab: " + " vs ".join(v.label for v in plan.variants)
    steps = plan.steps if plan.steps is not None else "the recipe's"
    intro = [f"{v.label}: {plan.config} " + " ".join(plan.common + v.overrides) for v in plan.variants]
    intro.append(f"{plan.repeats} repeat(s) × {steps} steps per variant, each a fresh process, interleaved "
                 f"({' '.join(v.label for v in plan.variants)} …); wall time {result.wall_s:.0f} s")
    out = plan.out_dir
    write_text_atomic(render_comparison_md(c, title=title, verdict=result.verdicts, intro=intro), out / "ab.md")
    write_text_atomic(render_comparison_html(c, title=title, verdict=result.verdicts, intro=intro,
                                             bad=result.exit_code != 0), out / "ab.html")
    write_json({"verdicts": result.verdicts, "exit_code": result.exit_code, "config": plan.config,
                "common_overrides": plan.common, "variants": {v.label: v.overrides for v in plan.variants},
                "repeats": plan.repeats, "steps": plan.steps, "wall_s": result.wall_s,
                "other_cpu_share": result.other_cpu, **c.to_dict()},
               out / "ab.json")
    if command:
        write_text_atomic(command + "\n", out / "command.txt")
    return [out / "ab.md", out / "ab.html", out / "ab.json"]


def _override_key(override: str) -> str:
    """``report.runs_dir`` of ``report.runs_dir=x`` (and of ``~report.runs_dir``)."""
    return override.partition("=")[0].strip().removeprefix("~")


"""Which checkpoint ``checkpoint.resume`` means: ``none``, a path, or ``auto``.

``auto`` continues an interrupted run: among earlier runs of the same name that are not running
now, it takes the newest complete checkpoint written with the same training hash (the config
less what does not change training, ``accelrun.config.resolve.NOT_TRAINING``). If that
checkpoint's run had finished, there is nothing to continue and training starts fresh.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from accelrun.config.errors import ConfigError
from accelrun.config.resolve import NOT_TRAINING, NOT_TRAINING_KEYS
from accelrun.report.lineage import continued_by
from accelrun.report.rundata import flatten
from accelrun.report.rundir import is_running, list_runs
from accelrun.train.checkpoint import (
    CheckpointInfo,
    checkpoints_and_damaged,
    complete_checkpoints,
    damage,
    read_info,
)

FINISHED_MARKER = "report.json"  # written when a run ends (finished or stopped on a bad loss)


@dataclass(frozen=True)
class ResumeDecision:
    checkpoint: CheckpointInfo | None
    reason: str


def decide_resume(resume: str, runs_root: Path, current_run: Path, training_hash: str) -> ResumeDecision:
    if resume == "none":
        return ResumeDecision(None, "checkpoint.resume = none")
    if resume != "auto":
        info, warning = _explicit(resume)
        return ResumeDecision(info, f"checkpoint.resume = {resume}{warning}")
    own = [i for i in complete_checkpoints(current_run / "checkpoints") if i.training_hash == training_hash]
    if own:  # a multi-node job's folder (named by its job id) entered again: SLURM requeued it
        return ResumeDecision(own[-1], f"continuing this job's own run {current_run.name} (requeued)")
    runs = [r for r in list_runs(runs_root.parent, runs_root.name) if r != current_run and not is_running(r)]
    found = [checkpoints_and_damaged(run / "checkpoints") for run in runs]
    matching = [info for good, _ in found for info in good if info.training_hash == training_hash]
    damaged = [(info, why) for _, bad in found for info, why in bad if info.training_hash == training_hash]
    if not matching:
        return ResumeDecision(None, f"no checkpoint with this training hash ({training_hash}) under {runs_root}"
                              + _skipped(damaged, None) + _other_training(runs, found, current_run))
    newest = max(matching, key=lambda i: (i.created, i.step))
    if (newest.run_dir / FINISHED_MARKER).exists():
        return ResumeDecision(None, f"the newest matching checkpoint's run finished ({newest.run_dir})")
    return ResumeDecision(newest, f"continuing the interrupted run {newest.run_dir.name}" + _skipped(damaged, newest))


def threads_of_the_run_resumed(resume: str, runs_root: Path, training_hash: str) -> int | None:
    """The CPU threads the run that ``resume`` would continue trained with (its env.json), or None: no
    such run, or one that did not record them. A product's sums split across another number of threads
    add up in another order, so a continuation with other threads parts from the uninterrupted run's
    losses within a step or two (39 of 60 losses differed, 1 thread against 2)."""
    about_to_start = runs_root / "(the run about to start)"  # its folder is made after the threads are set
    try:
        ckpt = decide_resume(resume, runs_root, about_to_start, training_hash).checkpoint
    except ConfigError:
        return None  # the run's setup says what is wrong with the path
    if ckpt is None or (resume != "auto" and not auto_would_continue(ckpt, about_to_start, training_hash)):
        return None  # nothing to continue, or a named checkpoint that starts a new run (setup says so)
    try:
        threads = json.loads((ckpt.run_dir / "env.json").read_text())["cpu"]["torch_threads"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return threads if isinstance(threads, int) and threads > 0 else None


def auto_would_continue(ckpt: CheckpointInfo, run_dir: Path, training_hash: str) -> bool:
    """Whether ``checkpoint.resume: auto`` would have continued ``ckpt`` in ``run_dir`` (its own choice, asked)."""
    chosen = decide_resume("auto", run_dir.parent, run_dir, training_hash).checkpoint
    return chosen is not None and chosen.path.resolve() == ckpt.path.resolve()


def _other_training(runs: list[Path], found: list, current_run: Path) -> str:
    """A note on the newest stopped run of this name whose checkpoints are of another training (a
    changed train.steps, say): what a user who meant to continue it looks for, with the values that
    differ where both recipes can be read (a new user was told only that one did). A finished run too
    where train.steps alone differs: a run extended by a rerun with more steps started afresh without a
    word (a trial's)."""
    ours = current_run / "config.yaml"
    candidates = []
    for run, (good, _) in zip(runs, found, strict=True):
        if not good or continued_by(run) is not None:
            continue
        finished = (run / FINISHED_MARKER).exists()
        differ = training_differences(run / "config.yaml", ours)
        if finished and not (differ and all(d.startswith("train.steps:") for d in differ)):
            continue
        candidates.append((run, good[-1], differ, "finished" if finished else "stopped"))
    if not candidates:
        return ""
    run, newest, differ, state = max(candidates, key=lambda c: (c[1].created, c[1].step))
    which = f"{', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}" if differ else \
        "its recipe differs in a value that decides the numbers trained"
    return (f"; the {state} run {run} has checkpoints of another training ({newest.training_hash}: {which}); "
            f"checkpoint.resume={run} continues from its newest checkpoint under this recipe, as a new run")


def training_differences(theirs: Path, ours: Path) -> list[str]:
    """``key: theirs -> ours`` for each value that decides the numbers trained and differs between two run
    folders' config.yaml (NOT_TRAINING left out); empty where either cannot be read."""
    try:
        a, b = (yaml.safe_load(p.read_text(encoding="utf-8")) for p in (theirs, ours))
    except (OSError, ValueError, yaml.YAMLError):
        return []
    if not isinstance(a, dict) or not isinstance(b, dict):
        return []

    launch_only = {".".join(k) for k in NOT_TRAINING_KEYS}
    fa, fb = ({k: v for k, v in flatten(d).items() if k.split(".")[0] not in NOT_TRAINING and k not in launch_only}
              for d in (a, b))
    return [f"{k}: {_value_said(fa.get(k))} there, {_value_said(fb.get(k))} now"
            for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def _value_said(value: object) -> str:
    """A recipe value as a difference names it: a key left out (None) is "unset", not ``None``."""
    return "unset" if value is None else repr(value)


def _skipped(damaged: list[tuple[CheckpointInfo, str]], chosen: CheckpointInfo | None) -> str:
    """A warning naming the damaged checkpoints newer than the one chosen (they would have been taken)."""
    newer = [(i, why) for i, why in damaged if chosen is None or (i.created, i.step) > (chosen.created, chosen.step)]
    if not newer:
        return ""
    names = "; ".join(f"{i.path} is damaged: {why}" for i, why in newer)
    return f"; warning: {names}" + ("; the previous complete checkpoint is used instead" if chosen else "")


def _explicit(resume: str) -> tuple[CheckpointInfo, str]:
    """A checkpoint folder, or the newest complete checkpoint of a run or checkpoints folder; with a
    warning when newer ones of that folder are damaged."""
    path = Path(resume).expanduser()
    info = read_info(path)
    if info is not None:
        why = damage(path)
        if why is not None:
            older = [i for i in complete_checkpoints(path.parent) if i.step < info.step]
            hint = f"; the newest complete one before it is {older[-1].path}" if older else ""
            raise ConfigError(f"checkpoint.resume = {resume}: the checkpoint is damaged: {why}{hint}")
        return info, ""
    for folder in (path / "checkpoints", path):
        latest, damaged = checkpoints_and_damaged(folder)
        if latest:
            return latest[-1], _skipped(damaged, latest[-1])
    raise ConfigError(
        f"checkpoint.resume = {resume}: not a complete checkpoint, nor a run or checkpoints "
        "folder holding one (a complete checkpoint has a COMPLETE file)"
    )

"""Which checkpoint ``checkpoint.resume`` means: ``none``, a path, or ``auto``.

``auto`` continues an interrupted run: among earlier runs of the same name that are not running
now, it takes the newest complete checkpoint written with the same training hash (the config
less what does not change training, ``accelrun.config.resolve.NOT_TRAINING``). If that
checkpoint's run had finished, there is nothing to continue and training starts fresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accelrun.config.errors import ConfigError
from accelrun.report.rundir import is_running, list_runs
from accelrun.train.checkpoint import CheckpointInfo, complete_checkpoints, read_info

FINISHED_MARKER = "report.json"  # written when a run ends (finished or stopped on a bad loss)


@dataclass(frozen=True)
class ResumeDecision:
    checkpoint: CheckpointInfo | None
    reason: str


def decide_resume(resume: str, runs_root: Path, current_run: Path, training_hash: str) -> ResumeDecision:
    if resume == "none":
        return ResumeDecision(None, "checkpoint.resume = none")
    if resume != "auto":
        return ResumeDecision(_explicit(resume), f"checkpoint.resume = {resume}")
    own = [i for i in complete_checkpoints(current_run / "checkpoints") if i.training_hash == training_hash]
    if own:  # a multi-node job's folder (named by its job id) entered again: SLURM requeued it
        return ResumeDecision(own[-1], f"continuing this job's own run {current_run.name} (requeued)")
    runs = [r for r in list_runs(runs_root.parent, runs_root.name) if r != current_run and not is_running(r)]
    matching = [info for run in runs for info in complete_checkpoints(run / "checkpoints")
                if info.training_hash == training_hash]
    if not matching:
        return ResumeDecision(None, f"no checkpoint with this training hash ({training_hash}) under {runs_root}")
    newest = max(matching, key=lambda i: (i.created, i.step))
    if (newest.run_dir / FINISHED_MARKER).exists():
        return ResumeDecision(None, f"the newest matching checkpoint's run finished ({newest.run_dir})")
    return ResumeDecision(newest, f"continuing the interrupted run {newest.run_dir.name}")


def _explicit(resume: str) -> CheckpointInfo:
    """A checkpoint folder, or the newest complete checkpoint of a run or checkpoints folder."""
    path = Path(resume).expanduser()
    info = read_info(path)
    if info is not None:
        return info
    latest = complete_checkpoints(path / "checkpoints") or complete_checkpoints(path)
    if not latest:
        raise ConfigError(
            f"checkpoint.resume = {resume}: not a complete checkpoint, nor a run or checkpoints "
            "folder holding one (a complete checkpoint has a COMPLETE file)"
        )
    return latest[-1]

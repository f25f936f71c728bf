"""Which checkpoint ``checkpoint.resume`` means: ``none``, a path, or ``auto``.

``auto`` continues an interrupted run: among earlier runs of the same name, it takes the newest
complete checkpoint written with the same config (hash, ignoring ``checkpoint.resume``). If that
checkpoint's run had finished, there is nothing to continue and training starts fresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accelrun.config.errors import ConfigError
from accelrun.train.checkpoint import CheckpointInfo, complete_checkpoints, read_info

FINISHED_MARKER = "report.json"  # written when a run ends (finished or stopped on a bad loss)


@dataclass(frozen=True)
class ResumeDecision:
    checkpoint: CheckpointInfo | None
    reason: str


def decide_resume(resume: str, runs_root: Path, current_run: Path, config_hash: str) -> ResumeDecision:
    if resume == "none":
        return ResumeDecision(None, "checkpoint.resume = none")
    if resume != "auto":
        path = Path(resume).expanduser()
        info = read_info(path)
        if info is None:
            latest = complete_checkpoints(path / "checkpoints") or complete_checkpoints(path)
            if not latest:
                raise ConfigError(
                    f"checkpoint.resume = {resume}: not a complete checkpoint, nor a run or checkpoints "
                    "folder holding one (a complete checkpoint has a COMPLETE file)"
                )
            info = latest[-1]
        return ResumeDecision(info, f"checkpoint.resume = {resume}")
    candidates = [
        info
        for run in sorted(runs_root.glob("*/")) if run.resolve() != current_run.resolve()
        for info in complete_checkpoints(run / "checkpoints")
    ]
    if not candidates:
        return ResumeDecision(None, f"no earlier checkpoint under {runs_root}")
    newest = max(candidates, key=lambda i: (i.created, i.step))
    if (newest.run_dir / FINISHED_MARKER).exists():
        return ResumeDecision(None, f"the newest checkpoint's run finished ({newest.run_dir}); starting fresh")
    if newest.config_hash != config_hash:
        return ResumeDecision(
            None,
            f"the newest checkpoint {newest.path} was written with config {newest.config_hash}, "
            f"this run's is {config_hash}; starting fresh (name it in checkpoint.resume to load it anyway)",
        )
    return ResumeDecision(newest, f"continuing the interrupted run {newest.run_dir.name}")

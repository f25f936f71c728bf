"""A run's model read back from one of its checkpoints into this one process (CPU, fp32), whatever
parallel layout wrote it (torch.distributed.checkpoint reshards on load): what ``accelrun export`` and
``accelrun generate`` start from."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import yaml

from accelrun.errors import UserError


class CheckpointModelError(UserError, ValueError):
    pass


def find_checkpoint(ref: str | Path, purpose: str) -> tuple[Path, Path]:
    """(checkpoint folder, run folder) for a checkpoint folder, a run folder (its newest complete
    checkpoint) or a folder of runs (the newest of its runs that saved one). ``purpose`` ends the error
    for a run without one."""
    from accelrun.report.rundata import RunNotFound, resolve_run_path
    from accelrun.train.checkpoint import TRAIN_STATE, complete_checkpoints

    path = Path(ref).expanduser()
    if (path / TRAIN_STATE).is_file():
        return path, path.parent.parent
    try:
        run = resolve_run_path(path)
    except RunNotFound as e:
        raise CheckpointModelError(str(e)) from None
    done = complete_checkpoints(run / "checkpoints")
    if not done and run != path:
        # A folder of runs: its newest run with a checkpoint. The newest run may have trained with
        # checkpoints off (a quick try after the real run), and the error then sent the user to train again.
        from accelrun.report.rundir import runs_in

        for older in runs_in(path):
            if done := complete_checkpoints(older / "checkpoints"):
                return done[-1].path, older
        raise CheckpointModelError(f"{path}: none of its runs saved a complete checkpoint {purpose} (the newest, "
                                   f"{run.name}, {_why_none(run) or 'has none'})")
    if not done:
        why = _why_none(run)
        raise CheckpointModelError(f"{run}: no complete checkpoint under {run / 'checkpoints'} {purpose}"
                                   + (f"; {why}" if why else ""))
    return done[-1].path, run


def others_in_folder(ref: str | Path, used: Path) -> str | None:
    """Where ``ref`` is a folder of runs: that it took its newest, and the run with the most steps saved
    where that is another (a trial's ``generate runs/llama-debug`` spoke from a 20-step try, not the
    300-step run beside it, and the line said only which it used). None otherwise."""
    from accelrun.report.rundir import runs_in
    from accelrun.train.checkpoint import TRAIN_STATE, complete_checkpoints

    folder = Path(ref).expanduser()
    if not folder.is_dir() or folder.resolve() == used.resolve() or (folder / TRAIN_STATE).is_file():
        return None
    saved = {r: done[-1] for r in runs_in(folder) if (done := complete_checkpoints(r / "checkpoints"))}
    if len(saved) < 2:
        return None
    longest = max(saved, key=lambda r: saved[r].step)
    said = f"{folder} holds {len(saved)} runs with checkpoints: this is its newest"
    if longest.resolve() != used.resolve():
        said += f"; the one trained longest is {longest} (step {saved[longest].step})"
    return said + "; name a run folder to use another"


def _why_none(run: Path) -> str:
    """Why ``run`` saved no checkpoint, where its config says, or ""."""
    if run_values(run).get("checkpoint", {}).get("enabled") is False:
        return "it trained with checkpoint.enabled = false, so it saved none (train again with it on)"
    return ""


def run_values(run: Path) -> dict:
    """The run's config.yaml as plain values ({} when it cannot be read: the caller's own error follows)."""
    try:
        data = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def model_config_of(run: Path, custom: bool = False) -> Any:
    """The run's resolved ``model`` section (the shape an HF folder gave it is already in it). A user's
    model (model.custom) only with ``custom``: its factory is imported and called to read it back."""
    from accelrun.config.schema import ModelConfig

    try:
        data = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise CheckpointModelError(f"{run}: no config.yaml; is this an accelrun run directory?") from None
    model = dict(data.get("model") or {})
    model["hf"] = None  # the folder it was loaded from need not exist any more
    cfg = ModelConfig.model_validate(model)
    if cfg.custom is not None and not custom:
        raise CheckpointModelError(
            f"{run}: model.custom = {cfg.custom!r}; only built-in model families can be read back from a "
            "checkpoint here. Its checkpoints are torch.distributed.checkpoint folders of your model's own "
            "state dict: torch.distributed.checkpoint.format_utils.dcp_to_torch_save(<checkpoint folder>, "
            "'model.pt') writes one file, whose ['model'] your factory's model loads with load_state_dict")
    return cfg


def hf_source_of(run: Path) -> Path | None:
    """The transformers folder (model.hf) run ``run`` was loaded from, or None (a built-in family's
    weights, or a run that predates the key)."""
    try:
        data = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        return None
    folder = (data.get("model") or {}).get("hf")
    return None if folder is None else Path(folder)


def run_tokenizer(run: Path) -> str:
    """The ``data.tokenizer`` run ``run`` trained with: ``byte`` (also for runs that predate the key), or
    the absolute path of its tokenizer.json or folder."""
    try:
        data = (yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}).get("data") or {}
    except FileNotFoundError:
        raise CheckpointModelError(f"{run}: no config.yaml; is this an accelrun run directory?") from None
    return str(data.get("tokenizer") or "byte")


def load_checkpoint_model(ref: str | Path, purpose: str, custom: bool = False) -> tuple[Any, Any, Path]:
    """(model in fp32 on the CPU, its ModelConfig, the checkpoint folder) for ``ref``; a user's model
    (model.custom, built by its factory, found as training found it) only with ``custom``."""
    import torch.distributed.checkpoint as dcp

    from accelrun.models import build_model

    ckpt, run = find_checkpoint(ref, purpose)
    cfg = model_config_of(run, custom)
    model = build_model(cfg, "cpu", seed=0)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # one process reading a DCP checkpoint is the intent here
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            # no_dist: under hf_on_finish this runs on the main rank of a job whose other ranks are done.
            dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    except Exception as e:
        raise CheckpointModelError(
            f"{ckpt}: cannot read the model's weights ({str(e).strip().splitlines()[0]})") from None
    model.load_state_dict(state["model"])
    return model.float(), cfg, ckpt

"""Export a run's weights as a Hugging Face folder (``accelrun export RUN --hf OUT``, and
``checkpoint.hf_on_finish``): config.json + sharded safetensors that transformers loads."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import yaml

from accelrun.errors import UserError
from accelrun.models.hf_io import export_hf


class ExportError(UserError, ValueError):
    pass


def _checkpoint_and_run(ref: str | Path) -> tuple[Path, Path]:
    """(checkpoint folder, run folder) for a checkpoint folder, a run folder (its newest complete
    checkpoint) or a folder of runs (its newest run)."""
    from accelrun.report.rundata import RunNotFound, resolve_run_path
    from accelrun.train.checkpoint import TRAIN_STATE, complete_checkpoints

    path = Path(ref).expanduser()
    if (path / TRAIN_STATE).is_file():
        return path, path.parent.parent
    try:
        run = resolve_run_path(path)
    except RunNotFound as e:
        raise ExportError(str(e)) from None
    done = complete_checkpoints(run / "checkpoints")
    if not done:
        raise ExportError(f"{run}: no complete checkpoint under {run / 'checkpoints'} to export")
    return done[-1].path, run


def _model_config(run: Path) -> Any:
    from accelrun.config.schema import ModelConfig

    try:
        data = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ExportError(f"{run}: no config.yaml; is this an accelrun run directory?") from None
    model = dict(data.get("model") or {})
    # The resolved config already holds the shape read from the HF folder; the folder need not exist now.
    model["hf"] = None
    cfg = ModelConfig.model_validate(model)
    if cfg.custom is not None:
        raise ExportError(f"{run}: model.custom = {cfg.custom!r}; only built-in model families export to HF")
    return cfg


def export_checkpoint(ref: str | Path, out: str | Path, *, max_shard_bytes: int = 2 * 2**30) -> list[Path]:
    """Write the model of checkpoint (or run) ``ref`` to ``out`` as a Hugging Face folder."""
    import torch.distributed.checkpoint as dcp

    from accelrun.models import build_model
    from accelrun.models.families import get_family

    ckpt, run = _checkpoint_and_run(ref)
    cfg = _model_config(run)
    model = build_model(cfg, "cpu", seed=0)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # one process reading a DCP checkpoint is the intent here
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            # no_dist: under hf_on_finish this runs on the main rank of a job whose other ranks are done.
            dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    except Exception as e:
        raise ExportError(f"{ckpt}: cannot read the model's weights ({str(e).strip().splitlines()[0]})") from None
    model.load_state_dict(state["model"])
    spec = get_family(cfg.arch)
    return export_hf(model.state_dict(), spec, spec.args_from_config(cfg), out, max_shard_bytes)

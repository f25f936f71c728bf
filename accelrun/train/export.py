"""Export a run's weights as a Hugging Face folder (``accelrun export RUN --hf OUT``, and
``checkpoint.hf_on_finish``): config.json + sharded safetensors that transformers loads."""

from __future__ import annotations

from pathlib import Path

from accelrun.models.hf_io import export_hf
from accelrun.train.checkpoint_model import load_checkpoint_model


def export_checkpoint(ref: str | Path, out: str | Path, *, max_shard_bytes: int = 2 * 2**30) -> list[Path]:
    """Write the model of checkpoint (or run) ``ref`` to ``out`` as a Hugging Face folder."""
    from accelrun.models.families import get_family

    model, cfg, _ = load_checkpoint_model(ref, "to export")
    spec = get_family(cfg.arch)
    return export_hf(model.state_dict(), spec, spec.args_from_config(cfg), out, max_shard_bytes)

"""``accelrun export``: a run's (or checkpoint's) model as a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import click

from accelrun.cli.common import err, out


@click.command("export")
@click.argument("ref", type=click.Path(path_type=Path))
@click.option("--hf", "hf_out", required=True, type=click.Path(path_type=Path),
              help="Folder to write config.json and *.safetensors (+ index) into.")
@click.option("--max-shard-gb", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Largest safetensors file (a single tensor may exceed it).")
def command(ref: Path, hf_out: Path, max_shard_gb: float) -> None:
    """Write the model of REF (a checkpoint folder, a run folder: its newest complete checkpoint, or a
    folder of runs: the newest of its runs that saved one) in Hugging Face format, for transformers'
    from_pretrained.

    \b
    Examples:
      accelrun export runs/hf-llama --hf exported/   # after a run of configs/hf-llama.yaml; before one: exit 2
      accelrun export runs/hf-llama/20260101-120000-ab12/checkpoints/step-000010 --hf out/  # exit 2 if absent
    """
    from accelrun.errors import UserError
    from accelrun.train.checkpoint_model import find_checkpoint
    from accelrun.train.export import export_checkpoint

    if hf_out.expanduser().exists() and not hf_out.expanduser().is_dir():
        raise UserError(f"--hf: {hf_out} is a file; give a folder (created if missing)")
    checkpoint, _ = find_checkpoint(ref, "to export")  # which one REF names (a run: its newest), once
    removed: list[Path] = []
    notes: list[str] = []
    written = export_checkpoint(checkpoint, hf_out, max_shard_bytes=int(max_shard_gb * 2**30), removed=removed,
                                notes=notes)
    for note in notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    out.print(f"wrote {len(written)} files to {hf_out} from {checkpoint}: " + ", ".join(p.name for p in written),
              markup=False, highlight=False)
    if removed:  # an earlier export's shards: transformers could have loaded them instead of these
        err.print(f"removed {len(removed)} weight file(s) of an earlier export there, which this one replaces: "
                  + ", ".join(p.name for p in removed), markup=False, highlight=False)

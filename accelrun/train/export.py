"""Export a run's weights as a Hugging Face folder (``accelrun export RUN --hf OUT``, and
``checkpoint.hf_on_finish``): config.json + sharded safetensors that transformers loads, and the
run's tokenizer files when it trained with a tokenizer.json."""

from __future__ import annotations

import shutil
from pathlib import Path

from accelrun.models.hf_io import export_hf
from accelrun.train.checkpoint_model import (
    CheckpointModelError,
    find_checkpoint,
    hf_source_of,
    load_checkpoint_model,
    run_tokenizer,
)

# The files transformers reads a tokenizer from; tokenizer.json is the one a run names, the others
# (when they sit beside it) carry its special tokens and its chat template (a chat fine-tune's export
# renders chats as it trained on them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_checkpoint(ref: str | Path, out: str | Path, *, max_shard_bytes: int = 2 * 2**30,
                      removed: list[Path] | None = None) -> list[Path]:
    """Write the model of checkpoint (or run) ``ref`` to ``out`` as a Hugging Face folder, with the
    tokenizer files of a run that trained with a tokenizer.json (a byte-level run has none to give).
    ``removed``: gets an earlier export's weight files there that this one replaced (``export_hf``)."""
    from accelrun.models.families import get_family

    tokenizer_files = _run_tokenizer_files(ref)  # before anything is written: a missing file is exit 2
    model, cfg, _ = load_checkpoint_model(ref, "to export")
    spec = get_family(cfg.arch)
    written = export_hf(model.state_dict(), spec, spec.args_from_config(cfg), out, max_shard_bytes, removed)
    out = Path(out).expanduser()
    if (source := hf_source_of(find_checkpoint(ref, "to export")[1])) is not None:
        written += _carry_source_folder(source, out)
    for f in tokenizer_files:
        if not (out / f.name).exists() or not (out / f.name).samefile(f):
            shutil.copyfile(f, out / f.name)
        written.append(out / f.name)
    return written


# Keys of a model.hf folder's config.json its export keeps where accelrun writes its own: what the model
# is to transformers (a Mistral with its sliding window, not a Llama attending to every position; its
# positions, which training read as the window) and the ids generation stops and pads at, which
# accelrun's config.json does not write (a fine-tuned export's generate() never stopped: a new user).
KEPT_FROM_SOURCE = ("architectures", "model_type", "max_position_embeddings", "sliding_window",
                    "bos_token_id", "eos_token_id", "pad_token_id")
# The weights' dtype is the export's (the checkpoint's), whichever name the source gave it.
DTYPE_KEYS = ("torch_dtype", "dtype")


def _carry_source_folder(source: Path, out: Path) -> list[Path]:
    """A run trained from a transformers folder (model.hf): its export's config.json is the source's with
    the keys accelrun wrote (the shape, whose values it read from there) put in, but for
    ``KEPT_FROM_SOURCE``, and its generation_config.json is copied. Nothing when the folder is gone."""
    import json

    source_config = source / "config.json"
    if not source_config.is_file():
        return []
    written = out / "config.json"
    ours, raw = json.loads(written.read_text()), json.loads(source_config.read_text())
    theirs = {k: v for k, v in raw.items() if k not in DTYPE_KEYS}
    merged = {**theirs, **{k: v for k, v in ours.items() if k not in KEPT_FROM_SOURCE or k not in theirs}}
    if "dtype" in raw:  # transformers 5's name for it, beside the older torch_dtype accelrun writes
        merged["dtype"] = ours.get("torch_dtype")
    written.write_text(json.dumps(merged, indent=2) + "\n")
    generation = source / "generation_config.json"
    if not generation.is_file():
        return []
    if not (out / generation.name).exists() or not (out / generation.name).samefile(generation):
        shutil.copyfile(generation, out / generation.name)
    return [out / generation.name]


def _run_tokenizer_files(ref: str | Path) -> list[Path]:
    from accelrun.config.tokenizer_file import BYTE, TokenizerFileError, tokenizer_json_path

    _, run = find_checkpoint(ref, "to export")
    name = run_tokenizer(run)
    if name == BYTE:
        return []
    try:
        path = tokenizer_json_path(name, key=f"{run}: data.tokenizer")
    except TokenizerFileError as e:
        raise CheckpointModelError(f"{e} (the run trained with it; the export would have no tokenizer)") from None
    return [path] + [path.parent / f for f in TOKENIZER_FILES[1:] if (path.parent / f).is_file()]

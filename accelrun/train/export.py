"""Export a run's weights as a Hugging Face folder (``accelrun export RUN --hf OUT``, and
``checkpoint.hf_on_finish``): config.json + sharded safetensors that transformers loads, and the
run's tokenizer files when it trained with a tokenizer.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from accelrun.config.hf_model import HF_CLASS_DEFAULTS
from accelrun.models.hf_io import export_hf
from accelrun.train.checkpoint_model import (
    CheckpointModelError,
    find_checkpoint,
    hf_source_of,
    load_checkpoint_model,
    model_config_of,
    run_tokenizer,
)

# The files transformers reads a tokenizer from; tokenizer.json is the one a run names, the others
# (when they sit beside it) carry its special tokens and its chat template (a chat fine-tune's export
# renders chats as it trained on them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_checkpoint(ref: str | Path, out: str | Path, *, max_shard_bytes: int = 2 * 2**30,
                      removed: list[Path] | None = None, notes: list[str] | None = None) -> list[Path]:
    """Write the model of checkpoint (or run) ``ref`` to ``out`` as a Hugging Face folder, with the
    tokenizer files of a run that trained with a tokenizer.json (a byte-level run has none to give).
    ``removed``: gets an earlier export's weight files there that this one replaced (``export_hf``);
    ``notes``: what the export could not carry over from the run's model.hf folder."""

    from accelrun.models.families import get_family

    checkpoint, run = find_checkpoint(ref, "to export")  # once: a folder of runs names its newest
    tokenizer_files = _run_tokenizer_files(run)  # before anything is written: a missing file is exit 2
    out = Path(out).expanduser()
    source = hf_source_of(run)
    if source is not None and out.exists() and out.resolve() == source.resolve():
        raise CheckpointModelError(f"--hf {out} is the folder the run was trained from (model.hf): the export "
                                   "would replace its weights and config.json; give another folder")
    _refuse_a_run_folder(out)
    source_config = _source_config(source)  # read before anything is written
    _refuse_what_has_no_hf_form(run)  # before its weights are read: they may take minutes
    model, cfg, _ = load_checkpoint_model(checkpoint, "to export", custom=True)
    if cfg.custom is not None:
        written = _save_pretrained(model, out, max_shard_bytes, removed)
    else:
        spec = get_family(cfg.arch)
        written = export_hf(model.state_dict(), spec, spec.args_from_config(cfg), out, max_shard_bytes, removed)
    own_tokenizer = source_config is not None and _same_tokenizer(tokenizer_files, source)
    if cfg.custom is None and not own_tokenizer:  # (with its own, the folder's ids are carried below)
        _write_token_ids(out / "config.json", _run_token_ids(run))
    if source is not None and source_config is None and notes is not None:
        notes.append(f"the run's model.hf folder {source} has no config.json now: the export says what "
                     "accelrun's model is (its model_type, token ids and generation settings are not carried over)")
    if source_config is not None:
        if not own_tokenizer and notes is not None and any(k in source_config for k in TOKEN_ID_KEYS):
            notes.append(f"the run did not train with {source}'s tokenizer: the export gives the ids of the one it "
                         "trained with, not that folder's BOS, EOS and padding ids, and leaves out its "
                         "generation_config.json")
        written += _carry_source_folder(source, source_config, out, own_tokenizer)
    for f in tokenizer_files:
        if not (out / f.name).exists() or not (out / f.name).samefile(f):
            shutil.copyfile(f, out / f.name)
        written.append(out / f.name)
    return written


def _refuse_a_run_folder(out: Path) -> None:
    """An export into a run's own folder, its checkpoints or a folder of runs mixes a model's config.json
    and weights with what accelrun reads back (a trial exported into the run folder itself, and `runs list`
    then read a folder holding both). Its ``hf`` subfolder, where ``checkpoint.hf_on_finish`` writes, is fine."""
    from accelrun.config.hf_model import RUN_EXPORT_FOLDER
    from accelrun.report.rundir import RUN_ID, holds_runs

    target = out.resolve()
    for folder in (target, *target.parents):
        if RUN_ID.match(folder.name) and (folder / "config.yaml").is_file():
            inside = target.relative_to(folder).parts
            if not inside or inside[0] == "checkpoints":
                where = f"the run folder {folder}" if not inside else f"inside the checkpoints of {folder}"
                raise CheckpointModelError(f"--hf {out} is {where}: the export would mix its files with the "
                                           f"run's; give a folder of its own, such as {folder / RUN_EXPORT_FOLDER}")
            return
    if target.is_dir() and holds_runs(target):
        raise CheckpointModelError(f"--hf {out} is a folder of runs: give a folder of its own, such as "
                                   f"{target / RUN_EXPORT_FOLDER}")


def _refuse_what_has_no_hf_form(run: Path) -> None:
    """A user's model (``model.custom``) exports only when its factory returns a transformers model
    (``PreTrainedModel``: ``save_pretrained``); told apart on the meta device, before any weight is read,
    or where the factory refuses the meta device (``from_pretrained``) by building it on the CPU, weights
    and all.
    Any other has no Hugging Face form to write (a new user's export of a Qwen2 they trained had been
    refused, with a way round by hand)."""
    from accelrun.errors import UserError
    from accelrun.models import build_model

    cfg = model_config_of(run, custom=True)
    if cfg.custom is None:
        return
    by_hand = ("Its checkpoints are torch.distributed.checkpoint folders of your model's own state dict: "
               "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(<checkpoint folder>, 'model.pt') writes "
               "one file, whose ['model'] your factory's model loads with load_state_dict")
    try:
        model = build_model(cfg, "meta", seed=0)
    except UserError:
        # A factory that loads weights (transformers' from_pretrained) refuses the meta device; export
        # builds it on the CPU anyway (a trial's from_pretrained factory could not be exported)
        try:
            model = build_model(cfg, "cpu", seed=0)
        except UserError as e:  # its module not found from here, ...
            raise CheckpointModelError(f"{run}: model.custom = {cfg.custom!r} could not be built to export it "
                                       f"({' '.join(e.messages)}). {by_hand}") from None
    if not callable(getattr(model, "save_pretrained", None)):
        raise CheckpointModelError(f"{run}: model.custom = {cfg.custom!r} is not a transformers model (no "
                                   f"save_pretrained), so it has no Hugging Face form to export. {by_hand}")


def _save_pretrained(model: object, out: Path, max_shard_bytes: int, removed: list[Path] | None) -> list[Path]:
    """A user's transformers model written as transformers writes it (its config.json and safetensors);
    returns the files written or changed, and adds to ``removed`` what it deleted (an earlier export's
    shards)."""
    def stamps() -> dict[Path, tuple[int, int]]:
        return {f: (f.stat().st_size, f.stat().st_mtime_ns) for f in out.rglob("*") if f.is_file()} if out.exists() else {}

    before = stamps()
    model.save_pretrained(out, max_shard_size=max_shard_bytes)
    after = stamps()
    if removed is not None:
        removed += sorted(set(before) - set(after))
    return sorted(f for f, stamp in after.items() if before.get(f) != stamp)


def _source_config(source: Path | None) -> dict | None:
    """The model.hf folder's config.json, or None where the folder or the file is gone."""
    if source is None or not (source / "config.json").is_file():
        return None
    try:
        config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointModelError(f"{source / 'config.json'} (the run's model.hf folder) cannot be read: {e}") from None
    return config if isinstance(config, dict) else None


def _same_tokenizer(tokenizer_files: list[Path], source: Path) -> bool:
    """Whether the run trained with the model.hf folder's own tokenizer: that file, or one of the same
    bytes elsewhere (a copy named by data.tokenizer)."""
    theirs = source / "tokenizer.json"
    if not tokenizer_files or not theirs.is_file():
        return False
    return tokenizer_files[0].read_bytes() == theirs.read_bytes()


# Keys of a model.hf folder's config.json its export keeps where accelrun writes its own: what the model
# is to transformers (a Mistral with its sliding window, not a Llama attending to every position).
KEPT_FROM_SOURCE = ("architectures", "model_type", "sliding_window")
# The ids generation starts, stops and pads at, which accelrun's config.json does not write (a fine-tuned
# export's generate() never stopped: a new user): the folder's, where the run trained with its tokenizer.
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Written by accelrun in its own form (the rotary embedding: rope_theta, rope_scaling, rope_parameters,
# which a user may have overridden), and the weights' dtype, the checkpoint's: the source's are dropped.
SOURCE_KEYS_DROPPED = ("rope_theta", "rope_scaling", "rope_parameters", "torch_dtype", "dtype")


def _carry_source_folder(source: Path, theirs: dict, out: Path, own_tokenizer: bool) -> list[Path]:
    """A run trained from a transformers folder (model.hf): its export's config.json is the source's
    with the keys accelrun wrote put in (the shape, whose values it read from there), but for
    ``KEPT_FROM_SOURCE``, the longer of the two position counts (a Mistral's training read its window),
    and the token ids where the run trained with the folder's tokenizer; its generation_config.json is
    copied with them."""
    written = out / "config.json"
    ours = json.loads(written.read_text())
    kept = {k: v for k, v in theirs.items() if k not in SOURCE_KEYS_DROPPED
            and (own_tokenizer or k not in TOKEN_ID_KEYS)}  # fmt: skip
    merged = {**kept, **{k: v for k, v in ours.items() if k not in KEPT_FROM_SOURCE or k not in kept}}
    # (a source config without the key has transformers' class default, not the window-clamped count the run
    # trained with: a review's)
    source_positions = theirs.get("max_position_embeddings") or HF_CLASS_DEFAULTS.get(
        str(theirs.get("model_type")), {}).get("max_position_embeddings")
    positions = [v for v in (ours.get("max_position_embeddings"), source_positions) if v]
    if positions:
        merged["max_position_embeddings"] = max(positions)
    if "dtype" in theirs:  # transformers 5's name for it, beside the older torch_dtype accelrun writes
        merged["dtype"] = ours.get("torch_dtype")
    written.write_text(json.dumps(merged, indent=2) + "\n")
    generation = source / "generation_config.json"
    if not own_tokenizer or not generation.is_file():
        return []
    if not (out / generation.name).exists() or not (out / generation.name).samefile(generation):
        shutil.copyfile(generation, out / generation.name)
    return [out / generation.name]


def _run_token_ids(run: Path) -> dict[str, int]:
    """The special ids the run trained with, for its export's config.json: the byte tokenizer's BOS and EOS,
    or the end-of-text id that separated a tokenizer.json's documents (from its tokenizer_config.json).
    Without them transformers took its defaults (eos 2, bos 1): a new user's export stopped generating at
    the token '!' and read its own end-of-text as the beginning."""
    from accelrun.config.tokenizer_file import BYTE, read_tokenizer_info
    from accelrun.data.tokenizer import ByteTokenizer

    name = run_tokenizer(run)
    if name == BYTE:
        return {"bos_token_id": ByteTokenizer.BOS, "eos_token_id": ByteTokenizer.EOS}
    eos = read_tokenizer_info(name, key=f"{run}: data.tokenizer").eos_id
    return {} if eos is None else {"eos_token_id": eos}


def _write_token_ids(config_file: Path, ids: dict[str, int]) -> None:
    if ids:
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, **ids}, indent=2) + "\n")


def _run_tokenizer_files(run: Path) -> list[Path]:
    from accelrun.config.tokenizer_file import BYTE, TokenizerFileError, tokenizer_json_path

    name = run_tokenizer(run)
    if name == BYTE:
        return []
    try:
        path = tokenizer_json_path(name, key=f"{run}: data.tokenizer")
    except TokenizerFileError as e:
        raise CheckpointModelError(f"{e} (the run trained with it; the export would have no tokenizer)") from None
    return [path] + [path.parent / f for f in TOKENIZER_FILES[1:] if (path.parent / f).is_file()]

"""Checks of the ``data`` section across its keys (no torch): the ``documents`` source and ``data.mix``.
``validate.consistency_problems`` runs them; each message names the keys and where they were set."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from accelrun.config.compose import Source
from accelrun.config.record_paths import EXTENSIONS as RECORD_EXTENSIONS
from accelrun.config.schema import DataConfig, MixSource, RunConfig
from accelrun.config.yaml_lines import KeyPath

SOURCES_WITH_PATHS = ("text", "tokens", "documents")


def data_problems(cfg: RunConfig, where: Callable[[KeyPath], Source], v: Callable[[str], str]) -> list[str]:
    """``where(path)`` says who set a key (its nearest set ancestor for a key nobody set); ``v(key)``
    renders ``key = value (where)``."""
    data = cfg.data
    if not data.mix:
        if not data.paths and data.source == "documents":
            return [f"{v('data.source')} needs data.paths: files, folders or globs of .jsonl, .json, .csv, "
                    ".parquet or .arrow files, or save_to_disk folders"]
        named = record_files_named(data.paths) if data.source == "text" else []
        return [record_files_as_text(named, v("data.source"), "data")] if named else []
    out: list[str] = []
    if data.paths:
        out.append(f"data.mix ({where(('data', 'mix'))}) and data.paths ({where(('data', 'paths'))}) are both set: "
                   "a mixture names each source's paths in its entry; remove data.paths")
    if data.format != "text":
        out.append(f"data.mix reads text from every source; {v('data.format')} is not supported with it (use text)")
    if cfg.eval.every > 0:
        out.append(f"data.mix with {v('eval.every')} is not supported yet: the held-out tail is one stream's "
                   "(set eval.every = 0)")
    for i, entry in enumerate(data.mix):
        key = f"data.mix.{i}"  # the spelling an override takes: data.mix.1.weight=0.3
        if not (entry.weight > 0 and math.isfinite(entry.weight)):
            out.append(f"{key}.weight = {entry.weight} ({where(('data', 'mix', i, 'weight'))}): a weight is a share of "
                       "the training tokens and must be > 0, e.g. 0.1; to leave a source out, remove its entry")
        if entry.source in SOURCES_WITH_PATHS and not entry.paths:
            out.append(f"{key}.source = {entry.source} ({where(('data', 'mix', i))}) needs {key}.paths: files or "
                       "globs to read")
        elif entry.source == "builtin" and entry.paths:
            out.append(f"{key}.paths is set but {key}.source = builtin reads no files ({where(('data', 'mix', i))})"
                       f"; {PATH_SOURCES_HINT}")
        elif entry.source == "text" and (named := record_files_named(entry.paths)):
            out.append(record_files_as_text(named, f"{key}.source = text ({where(('data', 'mix', i))})", key))
    return out


# What each source that reads files takes, for a message about a source that reads none.
PATH_SOURCES_HINT = ("use documents for .jsonl, .json, .csv, .parquet or .arrow records, text for plain text "
                     "files, tokens for token files")


def record_files_named(paths: Sequence[str]) -> list[str]:
    """The paths (files or globs) that name record files by their extension."""
    return [p for p in paths if any(p.lower().endswith(ext) for ext in RECORD_EXTENSIONS)]


def record_files_as_text(named: Sequence[str], source: str, key: str) -> str:
    """``text`` would read these record files (``record_files_named``) byte by byte, their JSON or binary
    layout included. ``source`` renders the setting, ``key`` is the section holding it (``data``,
    ``data.mix.1``)."""
    return (f"{source} reads files as plain text, byte by byte, and {key}.paths names record files "
            f"({', '.join(named[:3])}): use {key}.source=documents, which reads the text field of each record")


# Keys that only some data sources read.
DATA_KEYS_USED_BY = {
    "builtin": ("builtin", "tokenizer", "max_bytes"),
    "text": ("tokenizer", "max_bytes"),
    "tokens": ("tokenizer",),  # checked against the tokenizer each token file records
    "synthetic": (),
    "documents": ("tokenizer", "text_field", "format", "messages_field", "loss_on"),  # read whole, streamed
}

# Keys a mixture's entries decide for themselves (text_field) or that no entry reads. data.source and
# data.builtin are left out: the recipes a mix extends set them (recipes/data/stdlib.yaml), and a mix
# replacing them is what data.mix's description says.
KEYS_A_MIX_REPLACES = ("text_field", "max_bytes", "messages_field", "loss_on")


def mix_shares(mix: Sequence[MixSource]) -> str:
    """Each source of ``data.mix`` with the share of the tokens it gets: weights are relative (MixedBatchIterator
    divides them by their sum), so 0.7 and 0.2 read 78% and 22%."""
    total = sum(e.weight for e in mix)
    return ", ".join(f"{', '.join(e.paths) or e.source} {e.weight / total:.0%} (weight {e.weight:g})" for e in mix)


def mix_warnings(cfg: RunConfig, set_by_user: Callable[..., Source | None]) -> list[str]:
    """``data.mix`` set: the data keys its entries replace, where a user set them. Weights are relative (7 and 3
    as well as 0.7 and 0.3): not a warning; validate's and train's data line show the shares trained on."""
    if not cfg.data.mix:
        return []
    # (a key an entry's source reads applies to that entry: data.max_bytes cuts a text entry, and had been
    # said to have no effect while it did: a trial's)
    read = {key for e in cfg.data.mix for key in DATA_KEYS_USED_BY.get(e.source, ())} - {"text_field"}
    return [f"data.{key} ({src}) has no effect with data.mix: each entry names its own source, paths and text_field"
            for key in KEYS_A_MIX_REPLACES if key not in read and (src := set_by_user("data", key))]


def data_description(data: DataConfig) -> str:
    """What a run reads, for its report: the source (or each mixed source with its share), how many paths,
    the record format and the packing."""
    if data.mix:
        head = f"mix of {len(data.mix)} sources: {mix_shares(data.mix)}"
    elif data.source == "builtin":
        head = f"builtin ({data.builtin})"
    elif data.source == "synthetic":
        head = "synthetic"
    else:
        head = f"{data.source}: {paths_said(data.paths)}"
    fmt = f"; data.format {data.format}" if data.source == "documents" and not data.mix else ""
    return f"{head}{fmt}; packing {data.packing}"


def paths_said(paths: Sequence[str]) -> str:
    """data.paths as given (the first three, then how many more): "1 path(s)" said nothing of a glob."""
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


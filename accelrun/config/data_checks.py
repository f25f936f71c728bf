"""Checks of the ``data`` section across its keys (no torch): the ``documents`` source and ``data.mix``.
``validate.consistency_problems`` runs them; each message names the keys and where they were set."""

from __future__ import annotations

import math
from collections.abc import Callable

from accelrun.config.compose import Source
from accelrun.config.schema import RunConfig
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
        return []
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
            out.append(f"{key}.paths is set but {key}.source = builtin reads no files ({where(('data', 'mix', i))})")
    return out


# Keys a mixture's entries decide for themselves (text_field) or that no entry reads. data.source and
# data.builtin are left out: the recipes a mix extends set them (recipes/data/stdlib.yaml), and a mix
# replacing them is what data.mix's description says.
KEYS_A_MIX_REPLACES = ("text_field", "max_bytes", "messages_field", "loss_on")


def mix_warnings(cfg: RunConfig, set_by_user: Callable[..., Source | None]) -> list[str]:
    """``data.mix`` set: the data keys its entries replace, where a user set them."""
    if not cfg.data.mix:
        return []
    return [f"data.{key} ({src}) has no effect with data.mix: each entry names its own source, paths and text_field"
            for key in KEYS_A_MIX_REPLACES if (src := set_by_user("data", key))]

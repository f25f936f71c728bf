"""Load a recipe end to end: compose, override, validate; keep provenance and a content hash."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelrun.config.compose import Composed, Source, apply_override, compose_file
from accelrun.config.data_paths import did_you_mean
from accelrun.config.errors import ConfigError
from accelrun.config.hf_model import HFModelError, model_keys_from_hf_folder
from accelrun.config.hf_sources import hf_key_sources
from accelrun.config.schema import RUN_NAME_PATTERN, RunConfig
from accelrun.config.search import find_recipe, looks_like_path, search_path, search_path_warnings
from accelrun.config.validate import config_warnings, source_of, validate
from accelrun.config.yaml_lines import KeyPath, dotted, dump_recipe

# Sections that say where results go or what a planner assumes, not what is trained.
NOT_TRAINING = ("checkpoint", "report", "description", "cluster")


def values_hash(values: dict[str, Any]) -> str:
    """A short content hash of resolved values; a run's config.yaml read back gives its config's hash."""
    canonical = json.dumps(values, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


@dataclass
class ResolvedConfig:
    config: RunConfig
    sources: dict[KeyPath, Source]
    files: list[Path]
    overrides: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # values with no effect, and the like

    def to_dict(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json")

    def to_yaml(self) -> str:
        return dump_recipe(self.to_dict())

    @property
    def hash(self) -> str:
        """A short content hash of the resolved values (defaults included, sources not)."""
        return values_hash(self.to_dict())

    @property
    def training_hash(self) -> str:
        """Hash of what decides the numbers trained (not where or how often results are written).

        Checkpoints carry it, so ``checkpoint.resume: auto`` only continues a run with the same one.
        """
        return training_hash_of(self.to_dict())

    def _source_of_value(self, path: KeyPath, value: Any) -> Source:
        """Who set a leaf: a list one of whose items an override set names that override (a new user's
        ``train.optimizer.betas.0=0.5`` was said to come from the recipe file's line)."""
        return _item_override(self.sources, path, value) or source_of(path, self.sources)

    def explain(self) -> list[tuple[str, Any, Source]]:
        """(dotted key, value, source) for every leaf value of the resolved config."""
        rows: list[tuple[str, Any, Source]] = []

        def walk(value: Any, path: KeyPath) -> None:
            if isinstance(value, dict) and value:
                for k, sub in value.items():
                    walk(sub, path + (k,))
            else:
                rows.append((dotted(path), value, self._source_of_value(path, value)))

        walk(self.to_dict(), ())
        return rows


def _item_override(sources: dict[KeyPath, Source], path: KeyPath, value: Any) -> Source | None:
    """The last override of one of list ``value``'s items (``train.optimizer.betas.0=0.5``), or None."""
    if not isinstance(value, list):
        return None
    items = [sources[path + (i,)] for i in range(len(value)) if path + (i,) in sources]
    return next((src for src in reversed(items) if src.kind == "override"), None)


# Keys of training sections that only say how long to wait for the other processes: a rerun that raises
# a collective's timeout after a hang (what a user does) started again from step 0.
NOT_TRAINING_KEYS = (("parallel", "timeout_s"), ("parallel", "init_timeout_s"))


def training_hash_of(values: dict[str, Any]) -> str:
    """``ResolvedConfig.training_hash`` of resolved values (a run folder's config.yaml, read back)."""
    kept = {k: v for k, v in values.items() if k not in NOT_TRAINING}
    for section, key in NOT_TRAINING_KEYS:
        if isinstance(kept.get(section), dict) and key in kept[section]:
            kept[section] = {k: v for k, v in kept[section].items() if k != key}
    return values_hash(kept)


def training_hash_before_2026_12_07(values: dict[str, Any]) -> str:
    """The training hash as checkpoints written before 2026-12-07 carry it (the timeouts included)."""
    return values_hash({k: v for k, v in values.items() if k not in NOT_TRAINING})


def explain_text(resolved: ResolvedConfig) -> str:
    """The provenance table as aligned plain text: key, value, source; one line per value."""
    rows = [(k, repr(v), str(src)) for k, v, src in resolved.explain()]
    wk = max(len(r[0]) for r in rows)
    wv = min(max(len(r[1]) for r in rows), 40)
    return "".join(f"{k:<{wk}}  {v:<{wv}}  {src}\n" for k, v, src in rows)


def resolve_config_path(ref: str | Path, dirs: list[Path]) -> Path:
    """A config argument is a file path, or a recipe name on the search path."""
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    if looks_like_path(str(ref)) or path.suffix:
        hint = ""
        if not path.is_absolute() and path.parts[:1] == ("configs",) and not Path("configs").is_dir():  # outside a clone
            # The clone this accelrun runs from, if it does (an editable install): its file works from anywhere.
            # (A recipe name alone is no stand-in: model/debug trains the model without the compiler.)
            in_clone = Path(__file__).resolve().parents[2] / path
            hint = (f" (configs/ is the accelrun repository's folder of example recipes; this accelrun runs from a "
                    f"clone, where it is: give that path, {in_clone})" if in_clone.is_file() else
                    " (configs/ is the accelrun repository's folder of example recipes: run from a clone, or write "
                    "a recipe whose extends: lists the shipped recipes it builds on, as configs/llama.yaml does; "
                    "`accelrun recipes list` names them)")

        raise ConfigError(f"config file not found: {ref}{hint or did_you_mean(str(ref))}")
    return find_recipe(str(ref), dirs)


def load_config(
    ref: str | Path, overrides: Sequence[str] = (), search_dirs: list[Path] | None = None
) -> ResolvedConfig:
    """Compose ``ref`` (a file or recipe name) with its ``extends`` and ``overrides``, then validate.

    >>> rc = load_config("configs/llama.yaml", ["train.steps=10"])  # doctest: +SKIP
    >>> rc.config.train.steps, str(rc.sources[("train", "steps")])  # doctest: +SKIP
    (10, "override 'train.steps=10'")
    """
    dirs = search_path() if search_dirs is None else search_dirs
    composed: Composed = compose_file(resolve_config_path(ref, dirs), dirs)
    for text in overrides:
        apply_override(composed, text)
    hf_sources = _hf_folder_sources(composed.data)
    sources = {**composed.sources, **hf_sources}
    try:
        cfg = validate(composed.data, sources, composed.duplicate_keys)
    except HFModelError as e:  # a missing folder: say where model.hf was set (other errors name its file)
        if not str(e).startswith("model.hf = "):
            raise
        raise HFModelError(f"{e} (model.hf: {source_of(('model', 'hf'), sources)})") from None
    warnings = (search_path_warnings(composed.files, dirs) + _overrides_replaced_by_hf(composed, hf_sources, cfg)
                + config_warnings(cfg, sources))
    cfg = _named_after_custom_model(cfg, sources, composed.files)
    return ResolvedConfig(cfg, sources, composed.files, list(overrides), warnings)


def _named_after_custom_model(cfg: RunConfig, sources: dict[KeyPath, Source], files: list[Path]) -> RunConfig:
    """A run of ``model.custom`` is named after the user's module (``examples.my_model:build`` ->
    ``my_model``): the recipe's name is its own model's (``llama-debug``), and runs of another model
    filed under it mislead. A name given on the command line, or in the file that sets ``model.custom``
    or one applied after it (a user's own recipe, a team's recipe that extends it; a run folder's
    config.yaml, which the ranks reload), stays. ``sources`` says where each came from, ``files`` the
    order the files were applied in."""
    if cfg.model.custom is None:
        return cfg
    name_src, custom_src = sources.get(("name",), Source("default")), sources.get(("model", "custom"))
    if name_src.kind == "override" or (name_src.kind == "file" and custom_src is not None
                                       and custom_src.kind == "file"
                                       and _applied_at(name_src.file, files) >= _applied_at(custom_src.file, files)):
        return cfg
    module_path, _, attr = cfg.model.custom.partition(":")
    module = module_path.rsplit(".", 1)[-1].lstrip("_")
    if not re.match(RUN_NAME_PATTERN, module):  # a module named "_" leaves nothing to name the run after
        return cfg
    # A module of several factories (`zoo:qwen2`, `zoo:mixtral`) names each one's runs apart: all had gone
    # to runs/zoo/ (a new user's trial). The usual one-factory names say nothing more than the module.
    factory = attr.rsplit(".", 1)[-1].strip("_")
    named = module if factory.lower() in GENERIC_FACTORY_NAMES or not factory else f"{module}-{factory}"
    if not re.match(RUN_NAME_PATTERN, named):
        named = module
    sources[("name",)] = Source("derived", text="model.custom")
    return cfg.model_copy(update={"name": named})


GENERIC_FACTORY_NAMES = frozenset({"build", "make", "create", "model", "factory", "main", "get_model", "make_model",
                                   "build_model", "create_model", "new", "init"})


def _applied_at(file: str | None, files: list[Path]) -> int:
    """Where ``file`` comes in the order the recipe's files were applied (-1: not among them)."""
    resolved = [f.resolve() for f in files]
    return resolved.index(Path(file).resolve()) if file is not None and Path(file).resolve() in resolved else -1


def _overrides_replaced_by_hf(composed: Composed, hf_sources: dict[KeyPath, Source], cfg: RunConfig) -> list[str]:
    """A command-line override of a shape key the model.hf folder sets has no effect: say so."""
    out = []
    for path, src in hf_sources.items():
        given = composed.sources.get(path)
        if given is None or given.kind != "override" or len(path) != 2:
            continue
        value = composed.data.get(path[0], {}).get(path[1])
        if value != getattr(cfg.model, path[1], value):
            out.append(f"{dotted(path)} = {value!r} ({given}) has no effect: model.hf's {src} sets "
                       f"{getattr(cfg.model, path[1])!r}")
    return out


def _hf_folder_sources(data: dict[str, Any]) -> dict[KeyPath, Source]:
    """The lines of ``model.hf``'s config.json that set the model's shape keys, whatever the recipe
    said (a folder that cannot be read is left to validation, which names where ``model.hf`` was set)."""
    model = data.get("model")
    folder = model.get("hf") if isinstance(model, dict) else None
    if not isinstance(folder, str):
        return {}
    try:
        return hf_key_sources(folder, model_keys_from_hf_folder(folder))
    except (ConfigError, OSError, ValueError):
        return {}

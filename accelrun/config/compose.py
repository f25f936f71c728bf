"""Compose a recipe: its ``extends`` (in order), then the file itself, then command-line overrides.

Mappings merge key by key; anything else (scalars, lists) replaces what was there. Every value
keeps its provenance: the file and line, or the override, that set it last.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from accelrun.config.errors import ConfigError
from accelrun.config.search import find_recipe, looks_like_path
from accelrun.config.yaml_lines import KeyPath, load_yaml_file


@dataclass(frozen=True)
class Source:
    """Where a value came from: a file and line, a command-line override, or the schema default."""

    kind: str  # "file" | "override" | "default"
    file: str | None = None
    line: int | None = None
    text: str | None = None  # the override as typed

    def __str__(self) -> str:
        if self.kind == "file":
            return f"{_display_path(self.file)}:{self.line}"
        if self.kind == "override":
            return f"override '{self.text}'"
        return "default"


DEFAULT = Source("default")


def _display_path(path: str | None) -> str:
    """Paths under the working directory are shown relative to it, like a compiler's diagnostics."""
    try:
        rel = Path(path).relative_to(Path.cwd())
    except (TypeError, ValueError):
        return str(path)
    return str(rel)


@dataclass
class Composed:
    data: dict[str, Any]
    sources: dict[KeyPath, Source]
    files: list[Path]  # every file read, in the order their values were applied


def compose_file(path: Path, search_dirs: list[Path]) -> Composed:
    return _compose(path.resolve(), search_dirs, stack=())


def _compose(path: Path, search_dirs: list[Path], stack: tuple[Path, ...]) -> Composed:
    if path in stack:
        chain = " -> ".join(str(p) for p in stack + (path,))
        raise ConfigError(f"extends cycle: {chain}")
    located = load_yaml_file(path)
    raw = located.data
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}:1: a recipe must be a mapping of keys to values, got {type(raw).__name__}")
    out = Composed({}, {}, [])
    for ref, line in _extends_list(raw.pop("extends", None), located.lines, path):
        target = _resolve_ref(ref, path, line, search_dirs)
        parent = _compose(target, search_dirs, stack + (path,))
        merge_into(out, parent.data, parent.sources)
        out.files += [f for f in parent.files if f not in out.files]
    own = {k: Source("file", str(path), line) for k, line in located.lines.items() if k[:1] != ("extends",)}
    merge_into(out, raw, own)
    out.files.append(path)
    return out


def _extends_list(value: Any, lines: dict[KeyPath, int], path: Path) -> list[tuple[str, int]]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ConfigError(f"{path}:{lines.get(('extends',), 1)}: extends: expected a recipe name or a list of them")
    if isinstance(value, str):
        return [(value, lines[("extends",)])]
    return [(ref, lines.get(("extends", i), lines[("extends",)])) for i, ref in enumerate(items)]


def _resolve_ref(ref: str, including: Path, line: int, search_dirs: list[Path]) -> Path:
    if looks_like_path(ref):
        target = (including.parent / Path(ref).expanduser()).resolve()
        if not target.is_file():
            raise ConfigError(f"{including}:{line}: extends '{ref}': file not found (looked for {target})")
        return target
    try:
        return find_recipe(ref, search_dirs).resolve()
    except ConfigError as e:
        raise ConfigError(f"{including}:{line}: extends: {e.messages[0]}") from None


def merge_into(dst: Composed, data: dict, sources: dict[KeyPath, Source], prefix: KeyPath = ()) -> None:
    """Deep-merge ``data`` (with its ``sources``) into ``dst`` at ``prefix``."""
    target = _subtree(dst.data, prefix)
    for key, value in data.items():
        path = prefix + (key,)
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            dst.sources[path] = sources.get(path, dst.sources.get(path, DEFAULT))
            merge_into(dst, value, sources, path)
            continue
        _forget_below(dst.sources, path)
        target[key] = _copy(value)
        for p, s in sources.items():
            if p[: len(path)] == path:
                dst.sources[p] = s


def apply_override(dst: Composed, text: str) -> None:
    """Apply ``key.path=value`` (value parsed as YAML) or ``~key.path`` (remove the key)."""
    src = Source("override", text=text)
    if text.startswith("~"):
        path = _parse_key_path(text[1:], text)
        try:
            parent = _walk(dst.data, path[:-1], text)
        except ConfigError:
            parent = None
        if not isinstance(parent, dict) or path[-1] not in parent:
            raise ConfigError(f"override '{text}': nothing to remove at '{text[1:]}'")
        del parent[path[-1]]
        _forget_below(dst.sources, path)
        return
    key, sep, raw = text.partition("=")
    if not sep:
        raise ConfigError(f"override '{text}': expected key.path=value or ~key.path")
    path = _parse_key_path(key.strip(), text)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML: {getattr(e, 'problem', e)}") from None
    if any(isinstance(p, int) for p in path):
        _set_in_list(dst, path, value, src, text)
        return
    nested: Any = value
    for part in reversed(path):
        nested = {part: nested}
    leaf_sources = {path[: i + 1]: src for i in range(len(path))}
    if isinstance(value, dict | list):
        leaf_sources.update({path + p: src for p in _all_paths(value)})
    # Overrides replace a mapping only when the value is one: `train.optimizer={lr: 1}` merges.
    merge_into(dst, nested, leaf_sources)


def _set_in_list(dst: Composed, path: KeyPath, value: Any, src: Source, text: str) -> None:
    parent = _walk(dst.data, path[:-1], text)
    last = path[-1]
    if isinstance(parent, list) and not (isinstance(last, int) and last < len(parent)):
        raise ConfigError(f"override '{text}': index {last} is outside the list (length {len(parent)})")
    parent[last] = value
    _forget_below(dst.sources, path)
    dst.sources[path] = src


def _parse_key_path(key: str, text: str) -> KeyPath:
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}': '{key}' is not a dotted key path like train.steps")
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def _walk(data: Any, path: KeyPath, text: str) -> Any:
    for part in path:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            raise ConfigError(f"override '{text}': no key '{part}' on the way to '{'.'.join(map(str, path))}'")
    return data


def _subtree(data: dict, prefix: KeyPath) -> dict:
    for part in prefix:
        data = data.setdefault(part, {})
    return data


def _forget_below(sources: dict[KeyPath, Source], path: KeyPath) -> None:
    for p in [p for p in sources if p[: len(path)] == path]:
        del sources[p]


def _all_paths(value: Any, prefix: KeyPath = ()) -> list[KeyPath]:
    out: list[KeyPath] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for k, v in items:
        out.append(prefix + (k,))
        out += _all_paths(v, prefix + (k,))
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value

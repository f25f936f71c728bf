"""Compose a recipe: its ``extends`` (in order), then the file itself, then command-line overrides.

Mappings merge key by key; anything else (scalars, lists) replaces what was there. Every value
keeps its provenance: the file and line, or the override, that set it last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelrun.config.errors import ConfigError
from accelrun.config.search import find_recipe, looks_like_path
from accelrun.config.yaml_lines import KeyPath, display_path, dotted, load_yaml_file, load_yaml_with_lines


@dataclass(frozen=True)
class Source:
    """Where a value came from: a file and line, a command-line override, or the schema default."""

    kind: str  # "file" | "override" | "default" | "derived" (text: from which key)
    file: str | None = None
    line: int | None = None
    text: str | None = None  # the override as typed; for a file not in recipe syntax, the key read

    def __str__(self) -> str:
        if self.kind == "file":
            where = f"{display_path(self.file)}:{self.line}" if self.line else display_path(self.file)
            return f"{where} ({self.text})" if self.text else where  # text: the key read there, if not ours
        if self.kind == "override":
            return f"override '{self.text}'"
        if self.kind == "derived":
            return f"from {self.text}"
        return "default"


DEFAULT = Source("default")


@dataclass
class Composed:
    data: dict[str, Any]
    sources: dict[KeyPath, Source]
    files: list[Path]  # every file read, in the order their values were applied
    duplicate_keys: list[str] = field(default_factory=list)  # messages; validate reports them


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
        out.duplicate_keys += [m for m in parent.duplicate_keys if m not in out.duplicate_keys]
    own = {k: Source("file", str(path), line) for k, line in located.lines.items() if k[:1] != ("extends",)}
    merge_into(out, raw, own)
    out.files.append(path)
    out.duplicate_keys += [d.describe(display_path(path)) for d in located.duplicates]
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
    """Apply ``key.path=value`` (value parsed as YAML) or ``~key.path`` (remove the key or list item)."""
    if text.startswith("~"):
        _remove(dst, _parse_key_path(text[1:], text), text)
        return
    key, sep, raw = text.partition("=")
    if not sep:
        raise ConfigError(f"override '{text}': expected key.path=value or ~key.path")
    path = _parse_key_path(key.strip(), text)
    # The same bounded loader as recipe files: an override's value is YAML too (aliases included).
    located = load_yaml_with_lines(raw, f"override '{text}'") if raw.strip() else None
    if located and located.duplicates:
        raise ConfigError([f"override '{text}': duplicate key '{dotted(path + d.path)}'" for d in located.duplicates])
    value = located.data if located else ""
    if (glued := _glued_key(value)) is not None:  # (a trial's {dims:64} read as the key 'dims:64')
        name, _, rest = glued.partition(":")
        spaced = raw.strip().replace(glued, f"{name}: {rest}", 1)  # (the rest of the value as typed: a review's)
        raise ConfigError(f"override '{text}': '{glued}' reads as a key with no value: YAML needs a space after "
                          f"the colon, {key.strip()}={spaced}")
    src = Source("override", text=text)
    value_sources = {path + p: src for p in _all_paths(value)}
    if any(isinstance(p, int) for p in path):  # into a list: the containers on the way must exist
        parent, last = _container(dst.data, path, text)
        parent[last] = value
        _forget_below(dst.sources, path)
        dst.sources.update({path: src, **value_sources})
        return
    nested: Any = value
    for part in reversed(path):
        nested = {part: nested}
    # A mapping value merges into the mapping already there (`train.optimizer={lr: 1}` keeps the
    # other optimizer keys); any other value replaces what was there.
    merge_into(dst, nested, {**{path[: i + 1]: src for i in range(len(path))}, **value_sources})


def _glued_key(value: Any) -> str | None:
    """A mapping key with a colon and no value inside ``value`` (``{dims:64}``: YAML's flow mappings need a
    space after the colon), or None."""
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None and isinstance(k, str) and re.fullmatch(r"[A-Za-z_][\w.]*:\S+", k):
                return k
            if (inner := _glued_key(v)) is not None:
                return inner
    elif isinstance(value, list):
        return next((g for v in value if (g := _glued_key(v)) is not None), None)
    return None


def _remove(dst: Composed, path: KeyPath, text: str) -> None:
    try:
        parent, last = _container(dst.data, path, text)
    except ConfigError:
        parent, last = None, None
    if isinstance(parent, dict) and last in parent:
        del parent[last]
        _forget_below(dst.sources, path)
    elif isinstance(parent, list):
        del parent[last]
        _forget_below(dst.sources, path)
        _renumber_after(dst.sources, path)
    else:
        raise ConfigError(f"override '{text}': nothing to remove at '{text[1:]}'")


def _container(data: Any, path: KeyPath, text: str) -> tuple[dict | list, str | int]:
    """The mapping or list that holds ``path``'s last part, and that part (a valid list index)."""
    parent = _walk(data, path[:-1], text)
    last = path[-1]
    if isinstance(parent, list):
        if not (isinstance(last, int) and last < len(parent)):
            raise ConfigError(f"override '{text}': {last} is not an index of '{dotted(path[:-1])}' "
                              f"(a list of {len(parent)})")
    elif not isinstance(parent, dict):
        raise ConfigError(f"override '{text}': '{dotted(path[:-1])}' is {parent!r}, not a list or mapping")
    return parent, last


def _renumber_after(sources: dict[KeyPath, Source], removed: KeyPath) -> None:
    """After deleting list item ``removed``, the items behind it move up by one: so do their sources."""
    base, index = removed[:-1], removed[-1]
    moved = {}
    for p in [p for p in sources if p[: len(base)] == base and len(p) > len(base)]:
        i = p[len(base)]
        if isinstance(i, int) and i > index:
            moved[base + (i - 1,) + p[len(base) + 1 :]] = sources.pop(p)
    sources.update(moved)


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
            raise ConfigError(f"override '{text}': no key '{part}' on the way to '{dotted(path)}'")
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

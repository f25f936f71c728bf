"""Load YAML keeping the line of every key, so errors and provenance can point at it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from accelrun.config.errors import ConfigError

KeyPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Located:
    """A YAML document as plain Python values, and the 1-based line where each key path is set."""

    data: Any
    lines: dict[KeyPath, int]


def load_yaml_with_lines(text: str, origin: str) -> Located:
    """Parse ``text`` (named ``origin`` in errors). Duplicate keys are errors, not silent overwrites."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        raise ConfigError(f"{where}: YAML syntax error: {e.problem or e.context}") from None
    finally:
        loader.dispose()
    lines: dict[KeyPath, int] = {}
    if node is None:
        return Located({}, lines)
    try:
        return Located(_construct(node, (), lines, origin, loader), lines)
    except (yaml.constructor.ConstructorError, ValueError, TypeError) as e:  # e.g. `!!int abc`
        mark = getattr(e, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        raise ConfigError(f"{where}: YAML value error: {getattr(e, 'problem', None) or e}") from None


def load_yaml_file(path: Path) -> Located:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}): is this a YAML file?") from None
    return load_yaml_with_lines(text, str(path))


def _construct(node: yaml.Node, path: KeyPath, lines: dict, origin: str, loader: yaml.SafeLoader) -> Any:
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        loader.flatten_mapping(node)  # resolves YAML merge keys (<<)
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, str):
                raise ConfigError(f"{origin}:{line}: keys must be strings, got {key!r}")
            if key in out:
                first = lines[path + (key,)]
                raise ConfigError(f"{origin}:{line}: duplicate key '{dotted(path + (key,))}' (first set on line {first})")
            lines[path + (key,)] = line
            out[key] = _construct(value_node, path + (key,), lines, origin, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            items.append(_construct(item, path + (i,), lines, origin, loader))
        return items
    return loader.construct_object(node, deep=True)


def dotted(path: KeyPath) -> str:
    """("train", "optimizer", "lr") -> "train.optimizer.lr"."""
    return ".".join(str(p) for p in path)

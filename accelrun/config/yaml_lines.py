"""Load YAML keeping the line of every key, so errors and provenance can point at it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from accelrun.config.errors import ConfigError

KeyPath = tuple[str | int, ...]


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading an exponent without a decimal point (``1e-9``, ``3E5``) as a float,
    as YAML 1.2, JSON and Python do: PyYAML follows YAML 1.1, where it is a string. A setting typed as a
    float took it either way; a free-form one (``model.kwargs.eps=1e-6``, handed to a user's factory)
    arrived as the string "1e-6" and failed inside the user's code ("bad operand type for unary -")."""


class RecipeDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting a string that ``RecipeLoader`` would read as a float (``'1e5'``): a
    run's config.yaml is read back by its ranks, and a name or a quoted value came back a float."""


# YAML 1.2's floats that YAML 1.1 reads as strings: an exponent without a point (1e-9), an exponent
# without a sign (5.0e5, which a review found refused as "a quoted number"), a leading "-." (-.5).
# A number with neither a point nor an exponent stays an int.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(\.[0-9]+([eE][-+]?[0-9]+)?"
                             r"|[0-9][0-9_]*\.[0-9_]*([eE][-+]?[0-9]+)?"
                             r"|[0-9][0-9_]*[eE][-+]?[0-9]+)$")
for _cls in (RecipeLoader, RecipeDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+.0123456789"))


def dump_recipe(data: Any) -> str:
    """``data`` as YAML that ``RecipeLoader`` reads back as the same values."""
    return yaml.dump(data, Dumper=RecipeDumper, sort_keys=False, default_flow_style=None)

# Aliases let a few lines of YAML expand to billions of values (the "billion laughs"); a recipe is
# small, so its expanded size and its alias uses are bounded and an excess is an error, not a hang.
MAX_NODES = 100_000
MAX_ALIAS_USES = 1_000


class _Budget:
    def __init__(self, origin: str) -> None:
        self.origin, self.nodes, self.seen, self.aliases = origin, 0, set(), 0
        self.open: set[int] = set()  # nodes being expanded: an alias to one of them is a cycle
        self.duplicates: list[DuplicateKey] = []

    def enter(self, node: yaml.Node) -> None:
        where = f"{self.origin}:{node.start_mark.line + 1}"
        if id(node) in self.open:
            raise ConfigError(f"{where}: a YAML alias refers to a value that contains it (a cycle)")
        self.nodes += 1
        if id(node) in self.seen:
            self.aliases += 1
        self.seen.add(id(node))
        if self.nodes > MAX_NODES or self.aliases > MAX_ALIAS_USES:
            raise ConfigError(
                f"{where}: this YAML expands to more than {MAX_NODES:,} values or uses aliases more than "
                f"{MAX_ALIAS_USES:,} times (anchors and aliases nested into an exponential expansion?)"
            )


@dataclass(frozen=True)
class DuplicateKey:
    """A key set twice in one mapping of a YAML text: an error, reported with validation's."""

    path: KeyPath
    line: int
    first_line: int

    def describe(self, origin: str) -> str:
        return f"{origin}:{self.line}: duplicate key '{dotted(self.path)}' (first set on line {self.first_line})"


@dataclass(frozen=True)
class Located:
    """A YAML document as plain Python values, and the 1-based line where each key path is set.

    ``duplicates``: the keys set twice in a mapping (the later value is kept). They are errors,
    reported with validation's, so that one of them does not hide the text's other mistakes.
    """

    data: Any
    lines: dict[KeyPath, int]
    duplicates: list[DuplicateKey] = field(default_factory=list)


def _syntax_hint(text: str, mark: Any) -> str:
    """What a newcomer's YAML error usually is, said beside the parser's words (a trial's tab read "found
    character ... that cannot start any token"; a key indented one space too far, "mapping values are not
    allowed here")."""
    if mark is None:
        return ""
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    key = line.strip().split(":", 1)[0]
    if "\t" in line[: len(line) - len(line.lstrip())]:
        return f" (line {mark.line + 1}, {key!r}, is indented with a tab: YAML indents with spaces)"
    if mark.line > 0 and ":" in line:
        above = next((x for x in reversed(lines[: mark.line]) if x.strip() and not x.lstrip().startswith("#")), "")
        indent, above_indent = len(line) - len(line.lstrip()), len(above) - len(above.lstrip())
        if indent > above_indent and not above.rstrip().endswith(":"):
            return (f" (line {mark.line + 1}, {key!r}, is indented {indent - above_indent} more than the line "
                    f"above, which opens no section: indent it as the keys beside it)")
    return ""


def load_yaml_with_lines(text: str, origin: str) -> Located:
    """Parse ``text`` (named ``origin`` in errors). Duplicate keys are errors, not silent overwrites."""
    try:  # the reader checks the characters as the loader is made
        loader = RecipeLoader(text)
    except yaml.reader.ReaderError as e:  # control characters: a binary file that happens to be UTF-8
        raise ConfigError(f"{origin}: not YAML text (character {e.character:#x} at offset {e.position}): "
                          "is this a recipe file?") from None
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        raise ConfigError(f"{where}: YAML syntax error: {e.problem or e.context}{_syntax_hint(text, mark)}") from None
    finally:
        loader.dispose()
    lines: dict[KeyPath, int] = {}
    if node is None:
        return Located({}, lines)
    budget = _Budget(origin)
    try:
        return Located(_construct(node, (), lines, origin, loader, budget), lines, budget.duplicates)
    except (yaml.constructor.ConstructorError, ValueError, TypeError) as e:  # e.g. `!!int abc`
        mark = getattr(e, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        raise ConfigError(f"{where}: YAML value error: {getattr(e, 'problem', None) or e}") from None


def display_path(path: str | Path | None) -> str:
    """Paths under the working directory are shown relative to it, like a compiler's diagnostics (every
    message about a recipe file names it so: a syntax error's and a key's alike)."""
    try:
        rel = Path(path).relative_to(Path.cwd())
    except (TypeError, ValueError):
        return str(path)
    return str(rel)


def load_yaml_file(path: Path) -> Located:
    shown = display_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{shown}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{shown}: not UTF-8 text (byte {e.start}): is this a YAML file?") from None
    located = load_yaml_with_lines(text, shown)
    if located.data == {} and not located.lines:  # nothing but blanks and comments: almost always a mistake
        raise ConfigError(f"{shown}: the recipe is empty (no keys); a recipe names at least one setting "
                          "or extends another")
    return located


def _construct(node: yaml.Node, path: KeyPath, lines: dict, origin: str, loader: RecipeLoader,
               budget: _Budget) -> Any:
    budget.enter(node)
    if not isinstance(node, yaml.ScalarNode):
        budget.open.add(id(node))
        try:
            return _construct_collection(node, path, lines, origin, loader, budget)
        finally:
            budget.open.discard(id(node))
    return loader.construct_object(node, deep=True)


def _construct_collection(node: yaml.Node, path: KeyPath, lines: dict, origin: str, loader: RecipeLoader,
                          budget: _Budget) -> Any:
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
                budget.duplicates.append(DuplicateKey(path + (key,), line, first))
                _forget_below(lines, path + (key,))
            lines[path + (key,)] = line
            out[key] = _construct(value_node, path + (key,), lines, origin, loader, budget)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            items.append(_construct(item, path + (i,), lines, origin, loader, budget))
        return items
    return loader.construct_object(node, deep=True)  # a tagged collection (e.g. !!set)


def _forget_below(lines: dict[KeyPath, int], path: KeyPath) -> None:
    """A key set again: the lines of what its first value held no longer point anywhere."""
    for p in [p for p in lines if p[: len(path)] == path]:
        del lines[p]


def dotted(path: KeyPath) -> str:
    """("train", "optimizer", "lr") -> "train.optimizer.lr"."""
    return ".".join(str(p) for p in path)

"""Which files ``data.paths`` names (no torch): the data sources read them, and ``validate`` checks
them before anything is built."""

from __future__ import annotations

import difflib
import glob
import json
import os
from collections.abc import Sequence
from pathlib import Path

from accelrun.errors import DataError


def expand_paths(patterns: Sequence[str], *, key: str = "data.paths") -> list[Path]:
    """Files matched by ``patterns`` (plain paths or globs, ``**`` recursive), sorted per pattern,
    in pattern order, without duplicates. A pattern that matches no file is an error naming it.
    A folder written by ``accelrun data prepare`` (it holds ``prepared.json``) stands for its shards."""
    if not patterns:
        raise DataError(f"{key} is empty: give at least one file or glob")
    seen: set[str] = set()
    files: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob.glob(expanded, recursive=True))
        found = [f for m in matches for f in (_prepared_shards(m, key) if os.path.isdir(m) else [m])]
        if not found:
            raise DataError(f"{key}: {pattern!r} matched no files{_no_match_hint(pattern, matches, key)}")
        for m in found:
            # abspath, not realpath: overlapping globs are the duplicates that matter, and resolving
            # symlinks costs a syscall per path component (seconds for 50k files).
            a = os.path.abspath(m)
            if a not in seen:
                seen.add(a)
                files.append(Path(m))
    return files


def _prepared_shards(folder: str, key: str) -> list[str]:
    """The token shards of a prepared folder, in corpus order; nothing for any other folder."""
    manifest = os.path.join(folder, "prepared.json")
    if not os.path.isfile(manifest):
        return []
    try:
        with open(manifest) as fh:
            shards = json.load(fh)["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{key}: {manifest} is not a prepared folder's manifest ({e})") from None
    return [os.path.join(folder, s) for s in shards]


def _no_match_hint(pattern: str, matches: list[str], key: str) -> str:
    if matches:
        return " (it matches only directories; try 'DIR/**/*.txt')"
    if "," in pattern:  # `data.paths=a.txt,b.txt` is one path to YAML
        parts = ", ".join(p.strip() for p in pattern.split(","))
        return f" (several paths are a list: '{key}=[{parts}]')"
    return did_you_mean(pattern) + where_relative(pattern)


def nearest_file(path: str) -> str | None:
    """A file beside a path that names none, spelt like it (``my/doc.jsonl``: ``my/docs.jsonl``), as the
    user wrote the folder; None for a glob, a missing folder or nothing alike."""
    if glob.has_magic(path):
        return None
    folder, name = os.path.split(os.path.expanduser(path))
    try:
        siblings = [e.name for e in os.scandir(folder or ".") if e.is_file()]
    except OSError:
        return None
    close = difflib.get_close_matches(name, siblings, n=2, cutoff=0.8)
    if not close or (len(close) == 2 and _likeness(name, close[0]) == _likeness(name, close[1])):
        return None  # part.txt beside part0.txt and part1.txt: no one of them is meant
    return os.path.join(os.path.dirname(path), close[0])


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def did_you_mean(path: str) -> str:
    """`` (did you mean 'X'?)`` for ``nearest_file``'s X, or ""."""
    near = nearest_file(path)
    return f" (did you mean {near!r}?)" if near else ""


def where_relative(pattern: str) -> str:
    """Where a relative path was looked for: the current folder, not the recipe's (a recipe run from
    elsewhere finds nothing, and the message should say where it looked)."""
    if os.path.isabs(os.path.expanduser(pattern)):
        return ""
    return f" (looked for in the current folder, {os.getcwd()})"

"""Where recipes are found: the project's recipes/, then $ACCELRUN_RECIPE_PATH, then the shipped ones.

A recipe name is a path under a search directory without its suffix: ``parallel/fsdp`` is
``<dir>/parallel/fsdp.yaml``. The first directory that has it wins, so a team can shadow a
shipped recipe by putting its own under the same name earlier in the path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from accelrun.config.errors import ConfigError, nearest

RECIPE_PATH_ENV = "ACCELRUN_RECIPE_PATH"
SUFFIXES = (".yaml", ".yml")
# Shipped with the package (a link to the repository's recipes/ in a source checkout, named by where it
# leads, so that the search path and the files a recipe resolved from show one name for one folder).
SHIPPED_RECIPES = (Path(__file__).resolve().parent.parent / "recipes").resolve()


def search_path(cwd: Path | None = None) -> list[Path]:
    """The directories searched for recipe names, in priority order, without duplicates."""
    cwd = Path.cwd() if cwd is None else cwd
    dirs = [cwd / "recipes"]
    dirs += [Path(p).expanduser() for p in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep) if p]
    dirs.append(SHIPPED_RECIPES)
    seen: set[Path] = set()
    unique = []
    for d in dirs:
        key = d.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(d)
    return unique


def search_path_warnings(files: list[Path], dirs: list[Path]) -> list[str]:
    """What a user may not know the search path did: a recipe read from the project's recipes/ or
    $ACCELRUN_RECIPE_PATH in place of a shipped one of the same name (a team's `recipes/train/cpu-short.yaml`
    of two keys silently dropped the shipped schedule, clipping and learning rate), and a folder
    $ACCELRUN_RECIPE_PATH names that is not there."""
    out = []
    shipped = SHIPPED_RECIPES.resolve()
    read = [f.resolve() for f in files]
    roots = [r for r in (d.resolve() for d in dirs) if r != shipped]
    for f, path in zip(files, read, strict=True):
        for root in roots:
            if not path.is_relative_to(root):
                continue
            name = path.relative_to(root).with_suffix("").as_posix()
            theirs = [shipped / f"{name}{suffix}" for suffix in SUFFIXES]
            # (one that extends the shipped one by path keeps what it sets: nothing is lost)
            if any(t.is_file() and t.resolve() not in read for t in theirs):
                out.append(f"recipe '{name}' is {f}, which shadows the shipped recipe of that name (it comes "
                           "first on the search path): what the shipped one sets and this one does not is unset "
                           f"(the shipped one: {shipped / name}.yaml)")
            break
    for p in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep):
        if p and not Path(p).expanduser().is_dir():
            out.append(f"${RECIPE_PATH_ENV} names {p}, which is not a folder")
    return out


def looks_like_path(ref: str) -> bool:
    return ref.endswith(SUFFIXES) or ref.startswith(("./", "../", "/", "~"))


@dataclass(frozen=True)
class RecipeEntry:
    name: str
    path: Path
    summary: str  # the first sentence of the file's leading comment
    shadowed_by: Path | None = None


def find_recipe(name: str, dirs: list[Path]) -> Path:
    """The file for recipe ``name``; an error that lists what was searched when there is none."""
    for d in dirs:
        for suffix in SUFFIXES:
            candidate = d / f"{name}{suffix}"
            if candidate.is_file():
                return candidate
    known = [e.name for e in list_recipes(dirs)]
    hint = nearest(name, known)
    searched = ", ".join(str(d) for d in dirs)
    msg = f"recipe '{name}' not found (searched: {searched})"
    if hint:
        msg += f"; did you mean '{hint}'?"
    raise ConfigError(msg)


def list_recipes(dirs: list[Path]) -> list[RecipeEntry]:
    """Every recipe on the search path, sorted by name; a name found twice is marked shadowed."""
    first: dict[str, RecipeEntry] = {}
    shadowed: list[RecipeEntry] = []
    for d in dirs:
        if not d.is_dir():
            continue
        for path in sorted(p for p in d.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
            name = path.relative_to(d).with_suffix("").as_posix()
            entry = RecipeEntry(name, path, _summary(path))
            if name in first:
                shadowed.append(RecipeEntry(name, path, entry.summary, shadowed_by=first[name].path))
            else:
                first[name] = entry
    return sorted(list(first.values()) + shadowed, key=lambda e: (e.name, e.shadowed_by is not None))


def _summary(path: Path) -> str:
    """The first sentence of the comment block a recipe starts with (whole, never cut mid-sentence)."""
    words: list[str] = []
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("#"):
                    break
                words += line.lstrip("#").split()
    except OSError:
        return ""
    text = " ".join(words)
    end = re.search(r"[.!?](\s|$)", text)
    return text[: end.start() + 1] if end else text

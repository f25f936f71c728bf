"""Finding a user's model by its import path (``model.custom``): the folder searched, a module's likely
factories, and the nearest valid path to one written without its ``:factory``. Apart from
``models.build`` because the recipe's schema asks for the hint, and ``models.build`` reads the schema."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any


def search_current_folder() -> None:
    # The current folder is searched too, after everything else: `my_model:build` finds ./my_model.py
    # without PYTHONPATH, as a script beside it would, and no file here hides an installed module.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def custom_path_hint(path: str) -> str:
    """The nearest valid ``model.custom`` to one without its ``:factory`` ("; did you mean ...?"), found
    by importing: ``pkg.mod.build`` is ``pkg.mod:build`` when that module has it; ``pkg.mod``, a module
    itself, needs one of its callables named. "" when neither imports."""
    if ":" in path:
        return ""
    if path.endswith(".py") or "/" in path:  # a file: its module's name (the README promises the line to write)
        file, here = Path(path).expanduser().resolve(), Path.cwd().resolve()  # (a folder reached by a link)
        if not file.is_relative_to(here):  # (an absolute or ../ path made no module name: a review's)
            return (f"; a file is named by its module, from the folder its package is in: run there (or put that "
                    f"folder on PYTHONPATH) and give '{file.stem}:<factory>' or 'package.{file.stem}:<factory>'")
        module_name = ".".join(file.relative_to(here).with_suffix("").parts)
        search_current_folder()
        try:
            imported = importlib.import_module(module_name)
        except (Exception, SystemExit):  # noqa: BLE001 (as below)
            return f"; a file is named by its module, run from the folder above it: '{module_name}:<factory>'"
        names = module_callables(imported)
        return (f"; a file is named by its module: did you mean '{module_name}:{names[0] if names else '<factory>'}'? "
                f"(its callables: {', '.join(names[:8]) or 'none'})")
    module, _, name = path.rpartition(".")
    search_current_folder()
    for candidate, attr in ((module, name), (path, None)):
        if not candidate:
            continue
        try:
            imported = importlib.import_module(candidate)
        except (Exception, SystemExit):  # noqa: BLE001 (not a module, one that fails to import, a script that exits)
            continue
        if attr is None:
            names = module_callables(imported)
            return f"; did you mean '{candidate}:<factory>'? (its callables: {', '.join(names[:8]) or 'none'})"
        if callable(getattr(imported, attr, None)):
            return f"; did you mean '{candidate}:{attr}'?"
    return ""


def module_callables(owner: Any) -> list[str]:
    """The public callables of a module (or class), the likely factories first: functions before
    classes, those defined there before imported ones (``nn``'s, ``torch``'s)."""
    home = getattr(owner, "__name__", None)

    def rank(name: str) -> tuple[bool, bool, str]:
        obj = getattr(owner, name)
        return getattr(obj, "__module__", None) != home, isinstance(obj, type), name

    return sorted((n for n in dir(owner) if not n.startswith("_") and callable(getattr(owner, n, None))), key=rank)

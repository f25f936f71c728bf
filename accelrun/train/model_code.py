"""The source files a model's classes are defined in, by digest: saved with each checkpoint, so that a
run resumed after its model's code was edited says so (a new user changed a constant in their model's
file, and `resume: auto` went on from the old weights with the new code, the loss jumping from 2.4 to
8.9, with nothing said)."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

from torch import nn


def model_code(model: nn.Module) -> dict[str, str]:
    """module name -> sha256 of the file of each module that defines a class of ``model`` (torch's own left
    out). Keyed by module, not path: a run resumed from another checkout or a job's staged copy of the
    same code says nothing."""
    files: dict[str, str] = {}
    for cls in {type(m) for m in model.modules()}:
        if cls.__module__.split(".")[0] == "torch":
            continue
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:  # a class made at run time, or a builtin
            continue
        if path:
            files[cls.__module__] = path
    out = {}
    for module, path in sorted(files.items()):
        try:
            # (not traced_from.file_digest: that one is cached per process, as the code was imported)
            out[module] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            continue
    return out


def code_changes(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """The modules whose file differs, or that define the model's classes in one of the two only."""
    return sorted(m for m in saved.keys() | now.keys() if saved.get(m) != now.get(m))

"""The ``builtin`` source: a corpus every machine already has, so nothing is downloaded.

``python-stdlib`` is the ``.py`` source of the running Python's standard library (about 11 MiB
for CPython 3.11 once tests are left out). Paths are sorted, so the same Python gives the same
stream and the same fingerprint everywhere.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from accelrun.data.errors import DataError
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.stream import TensorStream
from accelrun.data.text import read_documents_with
from accelrun.data.tokenizer import ByteTokenizer

# Directories left out: installed packages are not the standard library, and test suites hold
# deliberately odd files (bad encodings, broken syntax) that are poor training text.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The standard library's ``.py`` files under ``root`` (default: this Python's), sorted."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return files


def load_builtin(name: str, *, max_bytes: int | None, tokenizer: ByteTokenizer | HFTokenizer | None = None,
                 ) -> TensorStream:
    """The corpus ``data.builtin`` names, read up to ``max_bytes`` of text, one document a file, in
    ``tokenizer``'s tokens (None: the byte tokenizer)."""
    if name != "python-stdlib":
        raise DataError(f"data.builtin: unknown corpus {name!r} (built in: 'python-stdlib')")
    files = stdlib_files()
    if not files:
        raise DataError(
            f"data.builtin: no .py files under {sysconfig.get_paths()['stdlib']!r}; this Python was "
            "installed without its library source (use data.source=text or synthetic)"
        )
    python = ".".join(map(str, sys.version_info[:3]))
    fingerprint = {"source": "builtin", "name": name, "python": python}
    return read_documents_with(tokenizer, files, max_bytes=max_bytes, fingerprint=fingerprint)

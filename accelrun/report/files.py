"""Atomic file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_text_atomic(text: str, path: str | Path) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(obj: object, path: str | Path) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    write_text_atomic(json.dumps(obj, indent=2) + "\n", path)

"""Data files written whole or not at all: a reader (a run, a resumed prepare) never sees half of one."""

from __future__ import annotations

import os
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, *parts: bytes) -> Path:
    """Write ``parts`` one after another to a temporary file beside ``path``, then rename it over ``path``."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            for part in parts:
                fh.write(part)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out

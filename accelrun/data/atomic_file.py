"""Data files written whole or not at all: a reader (a run, a resumed prepare) never sees half of one.

Work in progress goes to a hidden name beside the output (``.corpus.tmp-<host>-<pid>``) and is renamed
into place once complete. A process killed before then (SIGKILL, the OOM killer, a node lost) leaves its
scratch behind; the next write of the same output removes what dead processes of this host left
(another host's process may still be writing on a shared file system).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path


def scratch_path(out: Path, kind: str = "tmp") -> Path:
    """This process's hidden scratch name beside ``out`` (``kind``: tmp, old)."""
    return out.with_name(f".{out.name}.{kind}-{_host()}-{os.getpid()}")


def remove_dead_scratch(out: Path) -> list[Path]:
    """Remove the scratch files and folders beside ``out`` whose writer, a process of this host, has ended;
    returns what was removed."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:tmp|old)-{re.escape(_host())}-(\d+)$")
    removed = []
    try:
        siblings = list(out.parent.iterdir())
    except OSError:
        return removed
    for p in siblings:
        m = pattern.match(p.name)
        if m is None or _alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def write_bytes_atomic(path: str | os.PathLike, *parts: bytes) -> Path:
    """Write ``parts`` one after another to a temporary file beside ``path``, then rename it over ``path``."""
    out = Path(path)
    tmp = scratch_path(out)
    try:
        with open(tmp, "wb") as fh:
            for part in parts:
                fh.write(part)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True

"""Data files written whole or not at all: a reader (a run, a resumed prepare) never sees half of one.

Work in progress goes to a hidden name beside the output (``.corpus.tmp-<host>-<pid>``) and is renamed
into place once complete. A process killed before then (SIGKILL, the OOM killer, a node lost) leaves its
scratch behind; the next write of the same output removes it. The writer holds an exclusive ``flock`` on
its scratch while it works, and the kernel lets go of it when the writer dies, however it dies: a
scratch that can be locked has no writer, whatever host, container or PID namespace wrote it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # no flock (Windows): scratch is never removed for the writer's sake
    fcntl = None


def scratch_path(out: Path, kind: str = "tmp") -> Path:
    """This process's hidden scratch name beside ``out`` (``kind``: tmp, old)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()) or "host"
    return out.with_name(f".{out.name}.{kind}-{host}-{os.getpid()}")


def hold(scratch: Path) -> int | None:
    """Lock ``scratch`` (a file or folder that exists) for as long as this process (or a child it forks)
    keeps the returned descriptor open: ``remove_dead_scratch`` leaves it alone meanwhile."""
    if fcntl is None:
        return None
    fd = os.open(scratch, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def remove_dead_scratch(out: Path) -> list[Path]:
    """Remove the scratch files and folders beside ``out`` that no live writer holds; returns them."""
    if fcntl is None:
        return []
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:tmp|old)-")
    try:
        siblings = [p for p in out.parent.iterdir() if pattern.match(p.name) and not p.is_symlink()]
    except OSError:
        return []
    removed = []
    for p in siblings:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a writer holds it
            os.close(fd)
            continue
        try:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
            removed.append(p)
        finally:
            os.close(fd)
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

"""Run directories: ``<runs_dir>/<name>/<UTC YYYYmmdd-HHMMSS>-<6 hex>/``, created once, never reused.

Example::

    run_dir = create_run_dir("runs", "llama-debug")   # runs/llama-debug/20250101-120000-3fa9c1
    newest = list_runs("runs", "llama-debug")[0]
"""

from __future__ import annotations

import errno
import fcntl
import re
import secrets
import time
from pathlib import Path
from typing import IO

from accelrun.config.schema import RUN_NAME_PATTERN
from accelrun.errors import UserError

RUN_ID = re.compile(r"^(\d{8}-\d{6}-[0-9a-f]{6}|job-.+)$")
NAME = re.compile(RUN_NAME_PATTERN)
LOCK_FILE = ".lock"
MAX_ATTEMPTS = 100


def create_run_dir(runs_dir: str | Path, name: str) -> Path:
    """Make and return a new, empty run directory for run ``name`` under ``runs_dir``.

    The leaf is created with ``exist_ok=False``: two processes can never share a directory; on a
    collision (same second, same random id) a new id is drawn.
    """
    if not NAME.fullmatch(name):
        raise ValueError(f"run name must match {NAME.pattern} (no path separators), got {name!r}")
    parent = Path(runs_dir) / name
    for _ in range(MAX_ATTEMPTS):
        stamp = time.strftime(STAMP_FORMAT, time.gmtime())
        path = parent / f"{stamp}-{secrets.token_hex(3)}"
        try:
            _mkdir(path, runs_dir, parents=True, exist_ok=False)
        except FileExistsError:
            continue
        return path
    raise RuntimeError(f"could not create a new run directory under {parent} in {MAX_ATTEMPTS} attempts")


def list_runs(runs_dir: str | Path, name: str | None = None) -> list[Path]:
    """Run directories under ``runs_dir`` (of run ``name``, or of every name), newest first.

    Ordered by the timestamp in the directory name, then, within one second, by modification time.
    """
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    parents = [root / name] if name is not None else [p for p in root.iterdir() if p.is_dir()]
    runs = [run for parent in parents if parent.is_dir()
            for run in parent.iterdir() if run.is_dir() and RUN_ID.match(run.name)]
    return sorted(runs, key=lambda p: (started_stamp(p), p.stat().st_mtime_ns), reverse=True)


# A multi-node job's folder is named by its job id, not by when it started: the first node to make it
# writes the UTC start here, in a run folder's name format (``runs list`` showed "?" and sorted every
# job folder above every newer run).
STARTED_FILE = "started.txt"
STAMP_FORMAT = "%Y%m%d-%H%M%S"


def started_stamp(run_dir: Path) -> str:
    """When ``run_dir``'s run started, as ``YYYYmmdd-HHMMSS`` (UTC; sorts as it reads): from its name, or
    a job folder's start file, or (a job folder from before that file) its oldest file's time."""
    if not run_dir.name.startswith("job-"):
        return run_dir.name[:15]
    try:
        stamp = (run_dir / STARTED_FILE).read_text(encoding="utf-8").strip()
        time.strptime(stamp, STAMP_FORMAT)
        return stamp
    except (OSError, ValueError):
        pass
    return time.strftime(STAMP_FORMAT, time.gmtime(_oldest_file_time(run_dir)))


def _oldest_file_time(folder: Path) -> float:
    times = []
    for f in folder.iterdir():
        try:  # a temporary file of an atomic write may be gone by now
            if f.is_file():
                times.append(f.stat().st_mtime)
        except OSError:
            continue
    return min(times, default=None) or folder.stat().st_mtime


def runs_in(folder: Path) -> list[Path]:
    """The runs of a folder of runs, newest first: one recipe's (``runs/llama-debug``) or every recipe's
    (``runs``)."""
    return list_runs(folder.parent, folder.name) if holds_runs(folder) else list_runs(folder)


def holds_runs(folder: Path) -> bool:
    """Whether ``folder`` is one name's folder of runs (``runs/llama-debug``): a run folder directly in it."""
    return any(p.is_dir() and RUN_ID.match(p.name) for p in folder.iterdir())


def hold_run_lock(run_dir: Path, node: int = 0) -> IO:
    """Mark ``run_dir`` as running for as long as the returned file stays open (an flock, so a
    killed process releases it with no clean-up). Each node of a job holds its own."""
    f = open(run_dir / f"{LOCK_FILE}{node if node else ''}", "a")  # closed by the caller when the run ends
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


def is_running(run_dir: Path) -> bool:
    """Whether a live process holds one of ``run_dir``'s locks."""
    for lock in run_dir.glob(f"{LOCK_FILE}*"):
        try:
            with open(lock, "a") as f:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            continue
    return False


def job_run_dir(runs_dir: str | Path, name: str, job_id: str) -> Path:
    """The run directory every node of a multi-node job shares: named by the job (rendezvous) id."""
    if not NAME.fullmatch(job_id):
        raise ValueError(f"job id must match {NAME.pattern}, got {job_id!r}")
    path = Path(runs_dir) / name / f"job-{job_id}"
    _mkdir(path, runs_dir, parents=True, exist_ok=True)
    try:  # the first node (or the first run of the job) writes it; a requeued job keeps its start
        # (a job folder from before this file: its oldest file's time, not this requeue's)
        started = _oldest_file_time(path) if any(path.iterdir()) else time.time()
        with open(path / STARTED_FILE, "x", encoding="utf-8") as f:
            f.write(time.strftime(STAMP_FORMAT, time.gmtime(started)) + "\n")
    except FileExistsError:
        pass
    except OSError as e:
        raise unwritable(e, runs_dir) from None
    return path


class RunFolderError(UserError):
    """The run folder cannot be made or written: a message that says why, exit 2."""


_WHY = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
        errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "the disk quota is used up", errno.ENAMETOOLONG: "the path is too long"}


def unwritable(e: OSError, runs_dir: str | Path) -> RunFolderError:
    """The user's view of an OS error under ``runs_dir``: which path, why, which key to change."""
    where = Path(e.filename) if e.filename else Path(runs_dir)
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = next((p for p in [where, *where.parents] if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker else "a file stands in the path"
    else:
        why = _WHY.get(e.errno or 0, e.strerror or type(e).__name__)
    return RunFolderError(f"report.runs_dir = {runs_dir}: cannot write the run folder {where}: {why}; "
                          "set report.runs_dir to a folder you can write")


def _mkdir(path: Path, runs_dir: str | Path, **kw) -> None:
    try:
        path.mkdir(**kw)
    except FileExistsError:
        if kw.get("exist_ok") is False and path.is_dir():
            raise  # taken by another run: the caller draws another name
        raise unwritable(FileExistsError(errno.EEXIST, "File exists", str(path)), runs_dir) from None
    except OSError as e:
        raise unwritable(e, runs_dir) from None

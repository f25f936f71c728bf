"""Where a graph-cache entry's kernel files are, in the cache it is loaded from.

An entry names its kernels' files (a C++ library, a generated Triton module) by the paths they had when
it was saved. A cache copied, moved or mounted elsewhere (another ``ACCELRUN_CACHE_DIR``, a shared disk
at another path on another node) holds the same files under its own folder: found there first, by the
executor's folder and the file's name (both content-addressed), the saved path only where it has none.
Before, a moved cache loaded the old folder's kernels while that existed, and compiled afresh, with a
message that the file was gone, once it did not (a new user's trial, 2026-12-07).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

_root: ContextVar[Path | None] = ContextVar("accelrun_kernel_files_root", default=None)


@contextmanager
def kernel_files_under(root: Path) -> Iterator[None]:
    """Inside, saved kernel files are looked for under ``root`` (the compile cache: ``<root>/cpp``, ...)."""
    token = _root.set(root)
    try:
        yield
    finally:
        _root.reset(token)


def found(saved: str, what: str) -> Path:
    """The file saved as ``saved``, in the cache being loaded, else where it was saved; FileNotFoundError
    naming ``what`` if neither has it."""
    path = Path(saved)
    root = _root.get()
    here = root / path.parent.name / path.name if root is not None else path
    if here.exists():
        return here
    if not path.exists():
        if said := _build_failure(here) or _build_failure(path):
            raise FileNotFoundError(f"{what} {path.name} was never built: its build failed when the graph was "
                                    f"saved ({said})")
        raise FileNotFoundError(f"{what} {path.name} is not in the kernel cache (removed, or still being built by "
                                "another process that compiled it at the same time)")
    return path


def _build_failure(library: Path) -> str | None:
    """The compiler's error line a failed build of ``library`` left beside it (cpp_build), or None."""
    from accelrun.compile.codegen.cpp_build import failure_path

    try:
        return failure_path(library).read_text().strip() or None
    except OSError:
        return None

"""glibc malloc settings for training on a CPU: keep the step's activations in the process.

A training step allocates its activations in the forward and frees most of them in the backward.
With glibc's defaults, large blocks come from fresh ``mmap`` calls and the freed top of the heap is
handed back to the OS, so every step takes its activations' pages again: a page fault and a zeroed
page per 4 KiB (the debug Llama: 6,000-12,000 faults per step under accelrun's backend, 25,000-29,000
under eager; 0 once tuned). Two ``mallopt`` settings stop that:

- ``M_MMAP_THRESHOLD`` = 32 MiB (the largest glibc takes on 64-bit): smaller blocks come from the
  heap and are reused. Larger ones are still mapped afresh each time.
- ``M_TRIM_THRESHOLD`` = 1 GiB: freed memory stays in the process for the next step, up to 1 GiB
  of it at the heap's top. Resident memory then stays at the step's peak between steps.

A step's frees leave holes that later steps' allocations do not always fill (making AdamW's state
before the first step did not change that); kept resident, they raised peak RSS on torchtitan's
debug shape (16,384 tokens a step) from 1.8 GiB after the first step to 2.2-2.6 GiB by the fifth.
So ``tuned`` also calls ``malloc_trim(0)`` after the first step (which compiled, and freed what
compiling used) and after any step that grew the heap (``TrimWhenTheHeapGrows``): the holes' pages go
back to the OS and only those a later step uses come back. That shape then peaks at 2.0 GiB; the
debug Llama trims in its first three steps and never again, so its steady steps cost nothing more.

``train.cpu_malloc = lean`` is for memory first. The holes come from blocks between a few MiB and the
32 MiB threshold (on that shape, every [8, 2048, 256] fp32 activation is 16 MiB): ``lean`` maps blocks
from ``LEAN_MMAP_THRESHOLD`` = 16 MiB up afresh each time, so they leave no holes, and trims after every
step. That shape then peaks at 1.48 GiB instead of 2.1, with 20% fewer tokens/s (each of those blocks
faults its pages in again, 2026-11-27); the debug Llama's step, whose blocks are smaller, is 1.20x
slower from the trims alone. Trimming every step without the lower threshold gave 2.0 GiB there.

``train.cpu_malloc = system`` leaves glibc's defaults. Not glibc (musl, macOS): nothing is changed,
and the record says so.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
LEAN_MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # glibc only
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


TUNED = f"tuned: M_MMAP_THRESHOLD = {MMAP_THRESHOLD >> 20} MiB, M_TRIM_THRESHOLD = {TRIM_THRESHOLD >> 20} MiB"
LEAN = f"lean: M_MMAP_THRESHOLD = {LEAN_MMAP_THRESHOLD >> 20} MiB, M_TRIM_THRESHOLD = {TRIM_THRESHOLD >> 20} MiB"
_applied: str | None = None  # the mode whose mallopt settings this process has (they last as long as it)
_blocks_missing: str | None = None  # why the last ``blocks`` run has no block cache (None: it has one)


def tune_malloc(mode: str) -> None:
    """Apply ``mode`` (blocks | tuned | lean | system) to this process (``system``: nothing to do).
    ``blocks`` is ``tuned`` with accelrun's block cache as torch's CPU allocator (host_blocks); where the
    cache cannot be had, ``tuned`` alone, and ``malloc_record`` says why."""
    global _applied, _blocks_missing
    from accelrun.train import host_blocks

    _blocks_missing = host_blocks.install() if mode == "blocks" else None
    if mode != "blocks" and host_blocks.installed():  # an earlier run in this process left it
        host_blocks.uninstall()
    libc = _libc()
    glibc_mode = "tuned" if mode == "blocks" else mode
    if glibc_mode in ("tuned", "lean") and libc is not None and _applied != glibc_mode:
        mmap_threshold = LEAN_MMAP_THRESHOLD if glibc_mode == "lean" else MMAP_THRESHOLD
        if libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1:
            _applied = glibc_mode


def end_of_run(mode: str) -> None:
    """Give torch back its own CPU allocator after a ``blocks`` run (its free blocks unmapped), so that
    whatever the process does next (another run, a GPU run, a test) starts from torch's defaults."""
    global _blocks_missing
    from accelrun.train import host_blocks

    if mode == "blocks" and host_blocks.installed():
        host_blocks.uninstall()
    _blocks_missing = None


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): sizes over every arena, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


class TrimWhenTheHeapGrows:
    """``tuned``'s step end: ``malloc_trim(0)`` after the first step (which also compiled, and freed
    what compiling used) and whenever the heap has grown by more than ``slack`` bytes since the last
    trim. A step that fits in the holes earlier steps left costs nothing; growth means steps did not fit,
    leaving holes that later steps may never fill, and those pages go back to the OS (the next step
    faults back in only the ones it uses). ``heap_size`` None (glibc before 2.33, no ``mallinfo2``):
    only the first step's trim."""

    def __init__(self, libc: ctypes.CDLL, heap_size: Callable[[], int] | None, slack: int = 16 << 20) -> None:
        self.libc, self.heap_size, self.slack = libc, heap_size, slack
        self.heap_at_trim: int | None = None  # None: not trimmed yet
        self.trims = 0

    def __call__(self) -> None:
        if self.heap_at_trim is not None and self.heap_size is None:
            return
        heap = self.heap_size() if self.heap_size is not None else 0
        if self.heap_at_trim is None or heap > self.heap_at_trim + self.slack:
            self.libc.malloc_trim(0)
            self.trims += 1
            self.heap_at_trim = heap


def _heap_size(libc: ctypes.CDLL) -> Callable[[], int] | None:
    """Bytes the arenas hold (``mallinfo2().arena``), or None before glibc 2.33."""
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return lambda: libc.mallinfo2().arena


def step_end_release(mode: str) -> Callable[[], None] | None:
    """What to call after each step under ``mode``, or None: ``lean`` gives the heap's free pages back
    every step; ``tuned`` after the first step and after growth (``TrimWhenTheHeapGrows``)."""
    libc = _libc()
    if mode == "system" or libc is None:
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    if mode == "lean":
        return lambda: libc.malloc_trim(0)
    return TrimWhenTheHeapGrows(libc, _heap_size(libc))  # tuned, and blocks for the blocks under 1 MiB


def malloc_record(mode: str) -> str:
    """What a CPU process of the run has in effect, for env.json and the report."""
    from accelrun.train import host_blocks

    blocks = ""
    if mode == "blocks":  # after tune_malloc: what this process got; before (the launcher): what a rank will
        missing = None if host_blocks.installed() else _blocks_missing or host_blocks.unavailable()
        if missing is None:
            blocks = (f"blocks: from {host_blocks.MIN_BYTES >> 20} MiB mapped once and reused by size "
                      "(accelrun's allocator); smaller ones ")
        else:
            blocks = f"blocks unavailable ({missing}), tuned instead: "
        mode = "tuned"
    if _libc() is None:
        return f"{blocks}system: not glibc, left as is"
    if mode == "system":
        if _applied is None:
            return "system: glibc's defaults"
        return f"{LEAN if _applied == 'lean' else TUNED} (set earlier in this process)"
    if mode == "lean":
        return f"{LEAN}, malloc_trim after every step"
    if _heap_size(_libc()) is None:
        return f"{blocks}{TUNED}, malloc_trim after the first step (glibc before 2.33: heap growth is not seen)"
    return f"{blocks}{TUNED}, malloc_trim after the first step and any step that grew the heap"

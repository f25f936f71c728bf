"""accelrun's CPU allocator (``train.cpu_malloc = blocks``): a step's large blocks mapped once, reused by size.

glibc's heap either keeps a step's freed activations with the holes they leave (``tuned``: resident
memory above what is live) or maps them afresh each step (``lean``: every page faults in again).
``host_blocks.cpp`` is torch's CPU allocator for the run instead: a block of ``MIN_BYTES`` or more is
mapped once and, freed, waits on a free list for the next request of its size, its pages resident;
mapped memory stays within ``1 + HEADROOM_PERMILLE / 1000`` times the most bytes live blocks held at
once. Each block starts at its own cache-line offset in its mapping. Smaller blocks go to c10's own
``alloc_cpu``, as they would with torch's default allocator. Measured: docs/compiler.md (2026-11-28).

The library links against torch's ``libc10`` and is built by g++ once per machine (the C++ build
cache, about a second; the key holds torch's version, since the library subclasses c10's
``Allocator``). With no compiler, or where torch keeps another allocator, the run falls back to
``tuned`` and the record says so.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

MIN_BYTES = 1 << 20  # blocks from 1 MiB up; smaller ones are many, short-lived, and glibc's heap suits them
# Mapped memory may exceed the live peak by this many thousandths. A step asks for its sizes in an order
# that a pool held exactly at the live peak cannot always serve: it then unmaps one block to map another,
# which faults in again. torchtitan's debug shape, fp32 (2026-11-28): requests that mapped a new block
# in each steady step 20 at 0, 13 at 62, 4 at 250, 0 with no bound (1.38x the live peak mapped).
HEADROOM_PERMILLE = 250


@dataclass(frozen=True)
class BlockCounters:
    """What the cache has done in this process (bytes, and counts of requests)."""

    live: int  # bytes in blocks tensors hold now
    cached: int  # bytes in free blocks kept mapped for the next request of their size
    peak_live: int
    peak_mapped: int  # the most bytes mapped at once (live + cached)
    hits: int  # requests served from the free list
    misses: int  # requests that mapped a new block
    unmapped: int  # free blocks given back to the OS to stay under the mark
    small: int  # requests under MIN_BYTES, handed to c10's alloc_cpu
    requested: int  # what the live blocks' tensors asked for (page-rounded; a reused block may be larger)
    peak_requested: int
    # Counts and peaks are since the last install (a run's own).


def _link_flags() -> tuple[str, ...]:
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    torch_lib = os.path.join(torch_dir, "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # Unused by the source: puts torch's build in the cache key (an upgraded c10 may lay out Allocator anew).
    built_for = f"-DACCELRUN_FOR_TORCH={torch.__version__}-{torch.version.git_version}"
    return (built_for, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{os.path.join(torch_dir, 'include')}",
            f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}")


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or why there is none."""
    from accelrun.compile.codegen.cpp_build import build_and_load, find_compiler

    if find_compiler() is None:
        return "no C++ compiler (g++) to build it"
    source = (Path(__file__).with_name("host_blocks.cpp")).read_text()
    try:
        lib = build_and_load(source, link=_link_flags())
    except (RuntimeError, OSError) as e:
        lines = str(e).splitlines()
        first_error = next((ln.strip() for ln in lines if "error" in ln), lines[-1] if lines else type(e).__name__)
        return f"its build failed: {first_error}"
    lib.accelrun_blocks_install.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    lib.accelrun_blocks_stats.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
    return lib


def unavailable() -> str | None:
    """None where the cache can be built and loaded here (done once per machine), else why not."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def install() -> str | None:
    """Make the block cache torch's CPU allocator for this process; None, or why it is not."""
    lib = _library()
    if isinstance(lib, str):
        return lib
    if lib.accelrun_blocks_install(MIN_BYTES, HEADROOM_PERMILLE) != 1:
        return "torch keeps another CPU allocator with a higher priority"
    return None


def uninstall() -> None:
    """Give torch back its own allocator and unmap the free blocks (blocks still live stay valid)."""
    lib = _library()
    if not isinstance(lib, str):
        lib.accelrun_blocks_uninstall()


def _loaded() -> ctypes.CDLL | None:
    """The library if this process has already loaded it; never builds (every mode asks ``installed``)."""
    lib = _library() if _library.cache_info().currsize else None
    return None if isinstance(lib, str) else lib


def installed() -> bool:
    lib = _loaded()
    return lib is not None and lib.accelrun_blocks_installed() == 1


def counters() -> BlockCounters | None:
    """The cache's counters, or None where it was never loaded in this process."""
    lib = _loaded()
    if lib is None:
        return None
    values = (ctypes.c_size_t * len(dataclasses.fields(BlockCounters)))()
    lib.accelrun_blocks_stats(values)
    return BlockCounters(*values)

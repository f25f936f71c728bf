"""A hand-written kernel's shared library, one per element type, built by g++ on first need.

The fused kernels (``attention_cpu.cpp``, ``depthwise_conv_cpu.cpp``) are compiled once per machine and
dtype through ``cpp_build``'s on-disk cache. A pass may start the build in a thread while the rest of
compilation runs (``build_in_background``); the first call waits for it. A library that cannot be
built (no compiler after all, g++ refusing the source) is said once, as a warning, and ``get`` then
answers None: the ops compute with ATen instead.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from accelrun.compile.codegen.cpp_build import build_and_load

ELEMENT_TYPES = {torch.float32: "float", torch.bfloat16: "uint16_t"}  # the C type of each dtype's storage
_CONVERSIONS = Path(__file__).with_name("element_types.h")


def element_prelude(dtype: torch.dtype) -> str:
    """What a kernel's source starts with: ``ELEM`` defined as ``dtype``'s storage type, and the
    conversions to and from fp32 (``to_f32``, ``from_f32``) of every element type."""
    return f"#define ELEM {ELEMENT_TYPES[dtype]}\n" + _CONVERSIONS.read_text()

_libraries: weakref.WeakSet[PerDtypeLibrary] = weakref.WeakSet()


class PerDtypeLibrary:
    """``source(dtype)`` built and loaded once per dtype, ``declare(lib)`` then setting its argtypes.
    ``what`` and ``instead`` word the warning: "accelrun's {what} could not be built; {instead} (why)"."""

    def __init__(self, what: str, instead: str, source: Callable[[torch.dtype], str],
                 declare: Callable[[ctypes.CDLL], None]) -> None:  # fmt: skip
        self.what, self.instead, self.source, self.declare = what, instead, source, declare
        self._lock = threading.Lock()
        self._built: dict[torch.dtype, ctypes.CDLL | str] = {}  # the loaded library, or why it could not be built
        _libraries.add(self)

    def get(self, dtype: torch.dtype) -> ctypes.CDLL | None:
        """The library for ``dtype``, or None if it could not be built."""
        with self._lock:  # one build, whichever thread asks first (see build_in_background)
            if dtype not in self._built:
                try:
                    lib = build_and_load(self.source(dtype))
                    self.declare(lib)
                except Exception as e:  # noqa: BLE001 (no compiler after all, g++ refused the source, ...)
                    self._built[dtype] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    warnings.warn(f"accelrun's {self.what} could not be built; {self.instead} ({self._built[dtype]})",
                                  stacklevel=2)  # fmt: skip
                    return None
                self._built[dtype] = lib
            built = self._built[dtype]
            return built if isinstance(built, ctypes.CDLL) else None

    def failure(self, dtype: torch.dtype) -> str | None:
        """Why the library for ``dtype`` could not be built, or None (built, or not tried yet)."""
        built = self._built.get(dtype)
        return built if isinstance(built, str) else None

    def build_in_background(self, dtype: torch.dtype) -> None:
        """Start compiling (or finding in the cache) the library for ``dtype``: g++ runs beside the rest of
        compilation (tracing, AOTAutograd) instead of after it."""
        if dtype not in self._built:
            threading.Thread(target=self.get, args=(dtype,), name="accelrun-kernel-build", daemon=True).start()

    def _after_fork(self) -> None:  # a fork while a build thread held the lock must not leave it held
        self._lock = threading.Lock()


def _new_locks_after_fork() -> None:
    for library in list(_libraries):
        library._after_fork()


os.register_at_fork(after_in_child=_new_locks_after_fork)

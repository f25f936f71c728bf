"""Which library multiplies an fp32 matrix product on this CPU: ATen's (MKL's sgemm) or oneDNN's.

ATen runs every fp32 ``mm`` / ``addmm`` on a CPU through MKL, and so do eager PyTorch and Inductor's
training graphs. oneDNN, linked into the same torch, is often faster: on this project's AMD EPYC
(AVX-512, 2 threads), inside a training step of transformers' Llama, it multiplied the input
gradients 1.14-1.28x faster than MKL, the forward products from 1.06x slower to 1.12x faster, and
the weight gradients (a column-major left operand) up to 1.6x slower. The answer depends on the CPU,
the thread count, the layout, and on what the step leaves in the caches (timed apart from a step,
with operands warm in cache, the two differ in other places), so each layout is timed where it runs:

- ``GemmSite`` is a product in a compiled graph (the ``cpu_gemm`` pass puts it there). Until its
  layout is decided, its calls go through the layout's ``LayoutTuner``, which runs them through the
  two libraries in turns and times them: the first steps of training are the benchmark, no compile
  time is spent on it, and the machine is as busy as it will be while training. After
  ``UNTIMED_CALLS + TIMED_CALLS`` calls of each, oneDNN is kept where its median is ``MARGIN``
  faster; ATen otherwise.
- The choice goes to a file per machine, torch release and thread count (``ChoiceFile``): a second
  process compiles the decided layouts straight to their library and times nothing.

oneDNN's product is fp32 in, fp32 accumulated, fp32 out (``torch.backends.mkldnn``'s fp32 precision
stays the user's); it differs from MKL's only in summation order.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from accelrun.compile.pattern import same_size
from accelrun.torch_private import onednn_linear

FORMAT = 1  # of the cache files; a change makes every older file a miss
MARGIN = 0.03  # oneDNN replaces ATen only when this much faster: closer than that is timing noise
UNTIMED_CALLS = 1  # per library: the first call sets up (oneDNN builds its kernel for the shape)
TIMED_CALLS = 4  # per library, in turns, after those; the medians decide


class Library(str, Enum):
    ATEN = "aten"  # torch.mm / torch.addmm: MKL's sgemm on x86
    ONEDNN = "onednn"  # torch.ops.mkldnn._linear_pointwise


@dataclass(frozen=True)
class GemmLayout:
    """One product ``a @ b (+ bias)``: ``a`` is (m, k), ``b`` is (k, n), each row-major or column-major."""

    m: int
    k: int
    n: int
    a_col_major: bool
    b_col_major: bool
    bias: bool
    # A bucket of a changing size (ChangingGemmLayout.at): timed on calls of other sizes, so it is
    # chosen and saved apart from a product of exactly these sizes.
    bucket: bool = False

    @property
    def key(self) -> str:
        order = "".join("C" if c else "R" for c in (self.a_col_major, self.b_col_major))
        return f"{self.m}x{self.k}x{self.n}:{order}{':bias' if self.bias else ''}{':bucket' if self.bucket else ''}"


def bucket_of(size: int) -> int:
    """The power of two at or above ``size``: the size a changing dimension is timed and chosen at."""
    return 1 << (size - 1).bit_length()


@dataclass(frozen=True)
class ChangingGemmLayout:
    """A product whose sizes change between calls (a symbolic m, k or n), in a graph compiled for any
    sequence length: each call's layout is its own sizes, the changing ones rounded up to a
    power of two (``bucket_of``), so the products of one bucket share a choice (timed per multiply-add)
    and a new length is not a new layout to time."""

    sizes: tuple[int | None, int | None, int | None]  # m, k, n: a fixed size, or None where it changes
    a_col_major: bool
    b_col_major: bool
    bias: bool

    def at(self, m: int, k: int, n: int) -> GemmLayout:
        """The layout a call of sizes ``m, k, n`` is chosen and timed as."""
        sizes = (bucket_of(x) if fixed is None else x for x, fixed in zip((m, k, n), self.sizes, strict=True))
        return GemmLayout(*sizes, self.a_col_major, self.b_col_major, self.bias, bucket=True)

    @property
    def key(self) -> str:
        sizes = "x".join("?" if x is None else str(x) for x in self.sizes)
        order = "".join("C" if c else "R" for c in (self.a_col_major, self.b_col_major))
        return f"{sizes}:{order}{':bias' if self.bias else ''}"


def matrix_order(t: torch.Tensor) -> bool | None:
    """True for a column-major matrix, False for a row-major one, None for any other layout (a slice
    with gaps between rows, a broadcast): such a product stays with ATen. Symbolic sizes and strides
    count only where the order holds for every size (no guard)."""
    if t.dim() != 2 or same_size(t.numel(), 0):
        return None
    (rows, cols), (row_stride, col_stride) = t.shape, t.stride()

    def strides(row: Any, col: Any) -> bool:
        return same_size(row_stride, row) and same_size(col_stride, col)

    if strides(cols, 1) or same_size(cols, 1) and same_size(row_stride, 1):
        return False
    return True if strides(1, rows) else None


def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` through oneDNN: its linear layer takes the weight as (n, k), so ``b``'s transpose."""
    return _onednn_linear(a, b.t(), bias, "none", [], "")


_onednn_linear = onednn_linear() or (lambda *args: _no_onednn())


def _no_onednn() -> torch.Tensor:
    raise RuntimeError("this torch has no oneDNN (torch.backends.mkldnn.is_available() is False)")


def _aten_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


MULTIPLY = {Library.ATEN: _aten_mm, Library.ONEDNN: onednn_mm}  # each library's ``(a, b, bias) -> a @ b + bias``


@dataclass(frozen=True)
class Timing:
    library: Library
    aten_us: float
    onednn_us: float


def machine_key() -> str:
    """The CPU (model and feature flags), torch's release and the thread count: what the answer depends on."""
    from accelrun.compile.codegen.cpp_build import cpu_signature

    return f"{cpu_signature()}-torch{torch.__version__}-t{torch.get_num_threads()}"


def default_cache_dir() -> Path:
    from accelrun.compile.options import default_cache_dir as compile_cache_dir

    return compile_cache_dir() / "cpu_gemm"


class ChoiceFile:
    """The decided layouts of one machine key: ``<cache_dir>/<machine key>.json``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, Timing]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return {}
        known: dict[str, Timing] = {}
        for key, entry in data.get("choices", {}).items():
            try:
                known[key] = Timing(Library(entry["library"]), float(entry["aten_us"]), float(entry["onednn_us"]))
            except (KeyError, TypeError, ValueError):
                continue  # an entry this version cannot read: timed again
        return known

    def add(self, key: str, timing: Timing) -> None:
        """Adds one entry: the file is read again first (another process may have added its own), then
        replaced whole through a rename, so a reader never sees half a file."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            entries = self.read()
            entries[key] = timing
            choices = {k: {"library": t.library.value, "aten_us": round(t.aten_us, 1),
                           "onednn_us": round(t.onednn_us, 1)} for k, t in sorted(entries.items())}  # fmt: skip
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "machine": self.path.stem, "choices": choices}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache: the choice holds for this process, and is timed again in the next


class LayoutTuner:
    """One layout's choice in this process: read from the file, or made from the product's own first calls,
    which alternate between the libraries and are timed (the training's steps are the benchmark: no
    compile time is spent timing, and the machine is as busy as it will be while training)."""

    def __init__(self, layout: GemmLayout, file: ChoiceFile, known: Timing | None) -> None:
        self.layout, self.file = layout, file
        self.library: Library | None = known.library if known is not None else None
        self.times: dict[Library, list[float]] = {Library.ATEN: [], Library.ONEDNN: []}
        # A bucket's calls come in several sizes, and oneDNN builds a kernel for each new one: a
        # library's first call at a size is not timed (a fixed layout's first calls are UNTIMED_CALLS).
        self.sizes_met: set[tuple[Library, int, int, int]] = set()

    def timed_call(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        aten, dnn = self.times[Library.ATEN], self.times[Library.ONEDNN]
        if len(aten) == len(dnn):  # which goes first alternates: a layout's sites in a step (a block's
            # gate and up projections) read the same input, and the first of them reads it from memory
            lib = Library.ATEN if len(aten) % 2 == 0 else Library.ONEDNN
        else:
            lib = Library.ATEN if len(aten) < len(dnn) else Library.ONEDNN
        t0 = time.perf_counter()
        out = MULTIPLY[lib](a, b, bias)
        seconds = time.perf_counter() - t0
        m, k, n = a.shape[0], a.shape[1], b.shape[1]
        layout = self.layout
        if layout.bucket and (lib, m, k, n) not in self.sizes_met:
            self.sizes_met.add((lib, m, k, n))
            return out
        # A call in a bucket has fewer multiply-adds than the bucket: timed as if it had them.
        self.times[lib].append(seconds * (layout.m * layout.k * layout.n) / (m * k * n))
        if len(aten) == len(dnn) == UNTIMED_CALLS + TIMED_CALLS:
            self._decide()
        return out

    def _decide(self) -> None:
        aten, dnn = (statistics.median(self.times[lib][UNTIMED_CALLS:]) for lib in (Library.ATEN, Library.ONEDNN))
        timing = Timing(Library.ONEDNN if dnn < aten * (1 - MARGIN) else Library.ATEN, aten * 1e6, dnn * 1e6)
        self.library = timing.library
        self.file.add(self.layout.key, timing)


_tuners: dict[tuple[Path, str], LayoutTuner] = {}  # one per choice file and layout in a process
_files: dict[Path, dict[str, Timing]] = {}  # each choice file as this process first read it
_tuners_lock = threading.Lock()


def tuner_for(layout: GemmLayout) -> LayoutTuner:
    """The process's tuner of ``layout``: every product of that layout, in any graph, shares its timings
    and its choice."""
    path = default_cache_dir() / f"{machine_key()}.json"
    with _tuners_lock:
        tuner = _tuners.get((path, layout.key))
        if tuner is None:
            if path not in _files:
                _files[path] = ChoiceFile(path).read()
            tuner = _tuners[(path, layout.key)] = LayoutTuner(layout, ChoiceFile(path), _files[path].get(layout.key))
        return tuner


def undecided_layouts() -> list[str]:
    """The layouts this process met whose library is not chosen yet (neither read nor timed to the end)."""
    with _tuners_lock:
        return [tuner.layout.key for tuner in _tuners.values() if tuner.library is None]


class GemmSite:
    """One product in a compiled graph, called as ``site(a, b)`` or ``site(a, b, bias)``: through the
    library chosen for its layout, or, until that is chosen, through the layout's tuner. ``library``
    fixed at compile time (the pass's ``onednn`` option) never times."""

    reads_only = True  # (fast_calls) returns a fresh tensor and changes none of its inputs

    def __init__(self, layout: GemmLayout, library: Library | None = None) -> None:
        self.layout, self.fixed = layout, library
        self.tuner = tuner_for(layout) if library is None else None
        self.__name__ = "gemm"  # fx names the node and its generated code's global after it

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lib = self.fixed if self.tuner is None else self.tuner.library
        if lib is None:
            return self.tuner.timed_call(a, b, bias)
        return MULTIPLY[lib](a, b, bias)

    def __reduce__(self) -> tuple:  # the graph cache saves the layout; a loading process finds its own tuner
        return (type(self), (self.layout, self.fixed))

    def __repr__(self) -> str:  # what graph dumps print as the node's target
        return f"gemm[{self.layout.key}{'' if self.fixed is None else ':' + self.fixed.value}]"


class ChangingSizeGemmSite(GemmSite):
    """A product of a graph compiled for any size (``ChangingGemmLayout``): each call's sizes pick the
    tuner of their bucket's layout, kept per size met so that a step pays one dictionary lookup.

    A bucket's choice is timed on calls at sizes met before (``LayoutTuner``): right for sequence
    lengths, which come back every few steps. A mixture's expert meets a new token count at almost
    every call, and oneDNN builds a kernel for each new size (on this project's EPYC, a 1,024 x 96 x
    192 product took 231 us at a size met before, 647 at a new one, against ATen's 315): such a site
    runs ATen while its calls keep meeting new sizes (``sizes_rarely_repeat``), and is not timed then
    either: a bucket times a library's first call at a size apart (untimed), so it never decided, and
    half its calls went on building oneDNN kernels (a walk's mixture: 33 steps, 16 buckets undecided)."""

    def __init__(self, layout: ChangingGemmLayout, library: Library | None = None) -> None:
        self.layout, self.fixed, self.tuner = layout, library, None
        self._tuners: dict[tuple[int, int, int], LayoutTuner] = {}
        self._sizes_met: set[tuple[int, int, int]] = set()  # as many as the calls that met a size first
        self.calls = 0  # nonempty calls
        self.__name__ = "gemm"

    def __call__(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        sizes = (a.shape[0], a.shape[1], b.shape[1])
        if 0 in sizes:  # an expert that met no tokens: nothing to time, and oneDNN refuses an empty k
            return _aten_mm(a, b, bias)
        if self.fixed is not None:
            return MULTIPLY[self.fixed](a, b, bias)
        self.calls += 1
        self._sizes_met.add(sizes)
        if self.sizes_rarely_repeat():  # decided or not: a bucket timed on new sizes alone never decides
            return _aten_mm(a, b, bias)
        # Found only now: finding a size's tuner (its bucket's cache file and key) cost 0.1 ms, which an
        # expert meeting a new token count paid at every call (4 ms of a small mixture's 50 ms step).
        tuner = self._tuners.get(sizes)
        if tuner is None:
            tuner = self._tuners[sizes] = tuner_for(self.layout.at(*sizes))
        if tuner.library is None:
            return tuner.timed_call(a, b, bias)
        return MULTIPLY[tuner.library](a, b, bias)

    def sizes_rarely_repeat(self) -> bool:
        """Whether more than half of this site's calls (8 or more) met a size for the first time: a few
        sequence lengths in turn soon repeat; an expert's token counts rarely do."""
        return self.calls >= 8 and 2 * len(self._sizes_met) > self.calls

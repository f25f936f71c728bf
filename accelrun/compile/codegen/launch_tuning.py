"""Launch configurations of accelrun's Triton kernels, tuned per kernel and device (``compile.tune_launches``).

``triton.launches`` picks one configuration per kernel from its shape (a tile of about 4,096 elements,
16 elements a thread). What is fastest depends on the GPU too: Inductor times a few configurations
of each kernel the first time it runs and keeps the fastest. So does accelrun:

- ``candidates``: a small set per kernel kind, each valid for the source as written (the generator
  bakes some decisions into the text: a kernel with one row block has no row offset, a pointwise
  kernel with row and column blocks divides its program id by the column blocks, a two-stage column
  reduction's chunk of rows is a literal). Only what the source leaves free varies: warps always,
  rows per program where the source offsets rows, columns per program where it offsets columns
  alone, loop steps and pipeline stages where a kernel loops.
- ``tune``: each launch in order, every candidate timed by a ``LaunchTimer`` (CUDA events on the
  real call's buffers; the kernels only read their inputs and write their outputs and scratch, so
  running one many times changes nothing), the fastest kept if it beats the default (the first
  candidate) by ``MARGIN``. A launch-bound kernel (its default's time on the device no more than the
  host's time to issue it) keeps its default untimed against others: nothing to find, a compile per
  candidate to pay.
- ``TuningCache``: the choice is written beside the kernel's binaries (``triton_aot.binaries_dir``),
  one file per module and device, holding the module's source hash and the device's name and compute
  capability: a second process (or another graph with the same region) reads it and times nothing;
  another source or another GPU misses.

Tuning happens at a region's first call on the GPU (``TritonRegion``), where the buffers are real:
a compiled graph's first call runs eagerly even under CUDA graphs, so no capture sees it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from accelrun.compile.codegen.loop_ir import Kernel, LoopProgram
from accelrun.compile.codegen.triton import (
    MAX_WARPS,
    Launch,
    blocks_per_axis,
    cols_split,
    kernel_name,
    launches,
    looped,
)

FORMAT = 1  # of the cache files; a change makes every older file a miss
MAX_CANDIDATES = 8  # per launch: each is a Triton compile the first time (~0.1-0.5 s on a GPU host)
MAX_TILE = 16384  # elements a program holds (registers); the default tiles are 4,096
LOOP_STAGES = (1, 3)  # pipelining of a loop's loads: off, and Triton's default depth made explicit
# A candidate replaces the default only when this much faster: a small kernel's time between two events
# is partly the host's launching (triton.jit's path, ~20 us a launch), which is noise to the choice.
MARGIN = 0.03
# A launch-bound kernel is not tuned: the host's launching sets its time between two events, so no
# candidate can show itself faster, and each costs a compile. On an H200 every kernel of the debug Llama
# was such, and tuning them made its first step 25 s longer (34 s against 9 s) for no faster step
# (2026-11-27). The CUDA timer tells it by the host: its default's time on the device is within
# LAUNCH_BOUND_RATIO of the host's time to issue the launches (the device waited for the host). A timer
# that cannot tell (the tests' fakes) falls back to an absolute SMALL_KERNEL_MS.
LAUNCH_BOUND_RATIO = 1.25
SMALL_KERNEL_MS = 0.03


class KernelKind(str, Enum):
    POINTWISE = "pointwise"  # a rows kernel without reductions
    ROWS = "rows"  # each row reduced whole in one tile
    LOOPED_ROWS = "looped_rows"  # rows longer than a tile, walked in BLOCK_N steps
    COLS = "cols"  # a column reduction's main kernel (chunks of rows a program)
    COLS_FINAL = "cols_final"  # the second stage of a split column reduction


# Milliseconds of one launch with this configuration. A timer may also have ``launch_bound(launch, ms)
# -> bool`` (CudaEventTimer): whether the last timing of ``launch`` was the host's pace, not the device's;
# and ``compile(launches)``: build those configurations ahead of their timings, side by side.
LaunchTimer = Callable[[Launch], float]


def kernel_of(program: LoopProgram, launch: Launch) -> tuple[Kernel, KernelKind]:
    for k in program.kernels:
        name = kernel_name(k)
        if launch.kernel == f"{name}_final":
            return k, KernelKind.COLS_FINAL
        if launch.kernel == name:
            if k.kind == "cols":
                return k, KernelKind.COLS
            if looped(k):
                return k, KernelKind.LOOPED_ROWS
            return k, KernelKind.ROWS if k.has_reductions else KernelKind.POINTWISE
    raise KeyError(f"no kernel of the program launches as {launch.kernel}")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _warps(launch: Launch, tile: int) -> list[int]:
    """Half, the same, and twice the default, while every thread has an element to work on."""
    out = []
    for w in (launch.num_warps, launch.num_warps // 2, launch.num_warps * 2):
        if 1 <= w <= MAX_WARPS and w * 32 <= max(tile, 32) and w not in out:
            out.append(w)
    return out


def _sizes(default: int, lo: int, hi: int) -> list[int]:
    """The default (always), and half and twice it within [lo, hi]."""
    return [default] + [s for s in (default // 2, default * 2) if lo <= s <= hi]


def candidates(program: LoopProgram, launch: Launch) -> list[Launch]:
    """Configurations of ``launch`` its kernel's source allows; the default first."""
    kernel, kind = kernel_of(program, launch)
    blocks: list[tuple[int, int, tuple[int, ...]]] = []  # (block_r, block_n, grid)
    stages: tuple[int | None, ...] = (None,)
    if kind in (KernelKind.POINTWISE, KernelKind.ROWS):
        row_blocks, col_blocks = blocks_per_axis(kernel)
        rows_free = row_blocks > 1  # the source offsets rows by BLOCK_R
        cols_free = col_blocks > 1 and row_blocks == 1  # it offsets columns by BLOCK_N and nothing divides
        for br in _sizes(launch.block_r, 1, MAX_TILE) if rows_free else [launch.block_r]:
            for bn in _sizes(launch.block_n, 128, MAX_TILE) if cols_free else [launch.block_n]:
                if br * bn > MAX_TILE or (rows_free and br > launch.block_r and br >= kernel.rows * 2):
                    continue
                grid = _ceil(kernel.rows, br) * col_blocks if rows_free else _ceil(kernel.trips, bn) if cols_free \
                    else launch.grid[0]
                blocks.append((br, bn, (grid,)))
    elif kind is KernelKind.LOOPED_ROWS:
        stages = LOOP_STAGES
        for br in _sizes(launch.block_r, 1, 8):
            for bn in _sizes(launch.block_n, 512, 8192):
                if br * bn <= 8192:
                    blocks.append((br, bn, (_ceil(kernel.rows, br),)))
    elif kind is KernelKind.COLS:
        stages = LOOP_STAGES
        split = cols_split(kernel)
        for br in _sizes(launch.block_r, 1, split.rows_per_chunk):
            if split.rows_per_chunk % br:
                continue  # a chunk's loop must not step into the next chunk's rows
            for bn in _sizes(launch.block_n, 32, 1024):
                if br * bn <= MAX_TILE:
                    blocks.append((br, bn, (_ceil(kernel.trips, bn), split.chunks)))
    else:  # COLS_FINAL: loops over the partials; both sizes free
        stages = LOOP_STAGES
        for br in _sizes(launch.block_r, 1, 1024):
            for bn in _sizes(launch.block_n, 32, 1024):
                if br * bn <= MAX_TILE:
                    blocks.append((br, bn, (_ceil(kernel.trips, bn),)))
    out: list[Launch] = []
    for br, bn, grid in blocks:
        for w in _warps(launch, br * bn):
            for st in stages:
                c = replace(launch, block_r=br, block_n=bn, grid=grid, num_warps=w, num_stages=st)
                if c not in out:
                    out.append(c)
    default = replace(launch, num_stages=stages[-1] if len(stages) > 1 else None)
    # The default first (ties keep it), then the rest, nearest the default first: a cap keeps those.
    rest = sorted((c for c in out if c != default), key=lambda c: _distance(c, default))
    return [default, *rest][:MAX_CANDIDATES]


def _distance(a: Launch, b: Launch) -> int:
    return sum(x != y for x, y in ((a.block_r, b.block_r), (a.block_n, b.block_n), (a.num_warps, b.num_warps),
                                   (a.num_stages, b.num_stages)))  # fmt: skip


@dataclass(frozen=True)
class Tuned:
    launch: Launch
    ms: float  # the chosen configuration's time
    default_ms: float
    timed: int  # candidates timed


def tune(program: LoopProgram, time_launch: LaunchTimer, plan: list[Launch] | None = None) -> list[Tuned]:
    """Each launch of ``plan`` (default: the program's), its candidates timed, the fastest kept.

    First every launch's default, in order (a launch may read what the one before wrote: a split
    reduction's partials), which also tells the launch-bound ones; then the other candidates of the
    rest: built all at once where the timer can (``compile``: on a GPU host Triton's compiles run side
    by side, where one after another they made most of a cold first step), then timed launch by launch."""
    launch_bound = getattr(time_launch, "launch_bound", lambda launch, ms: ms < SMALL_KERNEL_MS)
    found = [candidates(program, launch) for launch in (plan if plan is not None else launches(program))]
    first_ms = [time_launch(default) for default, *_ in found]
    searched = [not launch_bound(c[0], ms) for c, ms in zip(found, first_ms, strict=True)]
    to_build = [c for (_, *others), search in zip(found, searched, strict=True) if search for c in others]
    compile_ahead = getattr(time_launch, "compile", None)
    if compile_ahead is not None and to_build:
        compile_ahead(to_build)
    out = []
    for (default, *others), ms, search in zip(found, first_ms, searched, strict=True):
        if not search:  # the default, without compiling the others
            out.append(Tuned(default, ms, ms, 1))
            continue
        # The default timed again beside its rivals: the device and host are as they are for them now
        # (after the builds), not as they were before.
        timed = [(time_launch(default), 0, default)] + [
            (_candidate_ms(time_launch, c), i, c) for i, c in enumerate(others, start=1)]
        best_ms, _, best = min(timed)
        default_ms = timed[0][0]
        if best_ms > default_ms * (1 - MARGIN):  # within noise of the default: keep the default
            best_ms, best = default_ms, default
        out.append(Tuned(best, best_ms, default_ms, len(timed)))
    return out


def _candidate_ms(time_launch: LaunchTimer, launch: Launch) -> float:
    """A candidate's time, or infinity where the device refuses it (more shared memory than it has,
    found only when the binary loads there; cross-compiling does not check): never picked, and the
    region keeps its other launches. The default's failure is the region's own, and propagates."""
    try:
        return time_launch(launch)
    except Exception:  # noqa: BLE001 (Triton's OutOfResources, a launch error, ...)
        return math.inf


@dataclass(frozen=True)
class DeviceKey:
    """What makes a configuration's speed another GPU's: the device, and the compiler that built it."""

    name: str  # "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int]
    triton: str

    def slug(self) -> str:
        text = f"{self.name}|{self.capability}|{self.triton}"
        return f"sm{self.capability[0]}{self.capability[1]}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def current_device_key() -> DeviceKey:
    import torch
    import triton

    index = torch.cuda.current_device()
    return DeviceKey(torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)),
                     triton.__version__)  # fmt: skip


class TuningCache:
    """Tuned launches of one generated module, one JSON file per device, beside the module's binaries."""

    def __init__(self, module_file: str | os.PathLike) -> None:
        from accelrun.compile.codegen.triton_aot import binaries_dir

        self.module_file = Path(module_file)
        self.directory = binaries_dir(module_file) / "launches"

    def path(self, device: DeviceKey) -> Path:
        return self.directory / f"{self.module_file.stem}.{device.slug()}.json"

    def _source_hash(self) -> str:
        return hashlib.sha256(self.module_file.read_bytes()).hexdigest()

    def read(self, device: DeviceKey) -> list[Launch] | None:
        """The tuned launches for ``device``, or None (never tuned here, another source, another device,
        a damaged file)."""
        path = self.path(device)
        try:
            data = json.loads(path.read_text())
            if (data["format"], data["source_sha256"], data["device"]) != (FORMAT, self._source_hash(),
                                                                            _device_json(device)):
                return None
            return [Launch(**{**d, "grid": tuple(d["grid"]), "args": tuple(d["args"]),
                              "scalars": tuple(map(tuple, d.get("scalars", ())))}) for d in data["launches"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, device: DeviceKey, tuned: list[Tuned]) -> Path:
        path = self.path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": FORMAT, "source_sha256": self._source_hash(), "device": _device_json(device),
                "launches": [asdict(t.launch) for t in tuned],
                "timings_ms": [{"kernel": t.launch.kernel, "chosen": t.ms, "default": t.default_ms,
                                "candidates": t.timed} for t in tuned]}  # fmt: skip
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)  # atomic: two processes tuning the same module each write a whole file
        return path


def _device_json(device: DeviceKey) -> dict[str, Any]:
    return {"name": device.name, "capability": list(device.capability), "triton": device.triton}


@dataclass
class TunedPlan:
    launches: list[Launch]
    source: str  # "cache" | "tuned"
    tuned: list[Tuned] | None = None


def tuned_launches(program: LoopProgram, module_file: str | os.PathLike, device: DeviceKey,
                   make_timer: Callable[[], LaunchTimer]) -> TunedPlan:  # fmt: skip
    """The launches to use on ``device``: from the cache beside the module, else tuned (``make_timer``
    is called only then) and written there."""
    cache = TuningCache(module_file)
    found = cache.read(device)
    if found is not None and [c.kernel for c in found] == [ln.kernel for ln in launches(program)]:
        return TunedPlan(found, "cache")
    tuned = tune(program, make_timer())
    cache.write(device, tuned)
    return TunedPlan([t.launch for t in tuned], "tuned", tuned)


def can_time() -> bool:
    """Whether kernels can be timed here: on a CUDA device, not under Triton's interpreter (whose times
    say nothing about a GPU). Tests replace it to drive the tuning on the CPU."""
    import torch

    return os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()


def cached_launches(program: LoopProgram, module_file: str | os.PathLike) -> list[Launch] | None:
    """The tuned launches for the current CUDA device, if the cache has them (a warm start: no timing)."""
    found = TuningCache(module_file).read(current_device_key())
    if found is None or [c.kernel for c in found] != [ln.kernel for ln in launches(program)]:
        return None
    return found


class CudaEventTimer:
    """Times a launch with CUDA events on the current stream: compiled and run once, then ``repeats``
    launches between two events, the mean; the host's time to issue them is kept beside it, so that
    ``launch_bound`` can tell a kernel the host's launching paces. ``slots``: each launch's buffer
    indices, by kernel name."""

    def __init__(self, module: Any, buffers: list[Any], slots: list[tuple[int, ...]], program: LoopProgram,
                 repeats: int = 20) -> None:  # fmt: skip
        self.module, self.buffers, self.repeats, self.program = module, buffers, repeats, program
        self.by_kernel = dict(zip([ln.kernel for ln in launches(program)], slots, strict=True))
        self.host_ms: dict[Launch, float] = {}  # per launch timed: the host's milliseconds to issue one

    def __call__(self, launch: Launch) -> float:
        import time

        import torch

        kernel = getattr(self.module, launch.kernel)
        args = [self.buffers[i] for i in self.by_kernel[launch.kernel]]
        kernel[launch.grid](*args, **launch.options())  # compiles (or loads) this configuration
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(self.repeats):
            kernel[launch.grid](*args, **launch.options())
        self.host_ms[launch] = (time.perf_counter() - t0) * 1e3 / self.repeats
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.repeats

    def launch_bound(self, launch: Launch, ms: float) -> bool:
        return ms <= self.host_ms[launch] * LAUNCH_BOUND_RATIO

    def compile(self, launches: list[Launch]) -> None:
        """Build these configurations now, side by side (``triton_aot.build_ahead``): their timings then
        find them built, and load each at its first launch (one that failed compiles and raises there)."""
        from accelrun.compile.codegen.triton_aot import build_ahead

        build_ahead([(self.program, self.module, launches)])


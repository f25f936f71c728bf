"""Triton for a ``LoopProgram``: one ``@triton.jit`` kernel per loop-IR kernel, plus a ``launch``.

Each program instance takes a ``BLOCK_R x BLOCK_N`` tile: ``r`` is a column vector of rows, ``c`` a
row vector of columns, so per-row (``outer``) values are ``[BLOCK_R, 1]`` and per-element (``inner``)
values ``[BLOCK_R, BLOCK_N]``. A kernel with row reductions holds a whole row in one tile
(``tl.sum(..., axis=1)``) when the row is at most ``MAX_ROW`` long; a longer row (a vocabulary's
softmax) is walked in ``LOOP_BLOCK_N`` chunks, one loop per inner block, folding each chunk into a
tile of partial accumulators (a value an earlier pass kept in a row buffer is recomputed instead; a
max and the sum of exponentials after it share one loop, see ``triton_online.py``). A
column reduction loops over row tiles. Shapes are baked in as literals. Grids are one-dimensional
where CUDA allows 2**31 - 1 programs (axes 1 and 2 allow 65,535).

The module is written into the cache directory (named by a hash of its text) and imported from
there, since ``triton.jit`` reads kernel source from files. On a CPU it runs under
``TRITON_INTERPRET=1``, which triton reads when the module is imported (decorated). On a GPU the
executor compiles every kernel before the first call (``triton_aot.warm_up``); ``triton_aot`` also
cross-compiles them for sm_90 / sm_100 on any machine (registers, spills). ``triton_region`` runs
the kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch

from accelrun.compile.codegen.emitter import Emitter
from accelrun.compile.codegen.index_print import print_index
from accelrun.compile.codegen.loop_ir import (
    Block,
    Buffer,
    C,
    Kernel,
    LoopProgram,
    Reduction,
    Stmt,
    Store,
    Unsupported,
)
from accelrun.compile.codegen.ops import INFIX, Renderer
from accelrun.compile.codegen.triton_online import OnlinePair, online_pairs

TILE_ELEMENTS = 4096  # elements a program instance works on, when the shapes allow
MAX_ROW = 8192  # a row reduced in one tile is at most this long; longer rows are reduced in a loop
LOOP_BLOCK_N = 2048  # columns per step of a looped row reduction
MAX_GRID = (2**31 - 1, 65535, 65535)  # CUDA's limits on a launch grid's axes
MIN_WARPS, MAX_WARPS = 2, 16
# Column reductions: columns per program, and how many programs to aim for (a few per SM of a large
# GPU) by cutting the rows into chunks of at least MIN_TILES_PER_CHUNK tiles each.
COLS_BLOCK_N = 256  # H100, 8192x1024 bf16: 47 us at 256 columns, 67 at 128, 930 with one program per block
TARGET_PROGRAMS = 512
MIN_TILES_PER_CHUNK = 2

TL_TYPE = {"f32": "tl.float32", "i64": "tl.int64", "i32": "tl.int32", "bool": "tl.int1"}
STORAGE = {"f32": "tl.float32", "bf16": "tl.bfloat16", "f16": "tl.float16", "i64": "tl.int64",
           "i32": "tl.int32", "i16": "tl.int16", "i8": "tl.int8", "u8": "tl.uint8", "bool": "tl.int1"}

class TritonOps(Renderer):
    name = "Triton"
    one = "1.0"
    primitives = {
        **INFIX, "and": "({0} & {1})", "or": "({0} | {1})", "not": "({0} == 0)", "pow": "libdevice.pow({0}, {1})",
        "abs": "tl.abs({0})", "exp": "tl.exp({0})", "log": "tl.log({0})", "log1p": "libdevice.log1p({0})",
        "expm1": "libdevice.expm1({0})", "tanh": "libdevice.tanh({0})", "rsqrt": "tl.rsqrt({0})",
        "sqrt": "tl.sqrt({0})", "erf": "tl.erf({0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})",
        "floor": "tl.floor({0})", "ceil": "tl.ceil({0})", "trunc": "libdevice.trunc({0})",
        "sign": "(({0} > 0).to(tl.int32) - ({0} < 0).to(tl.int32))",
        "round_bf16": "{0}.to(tl.bfloat16).to(tl.float32)", "round_f16": "{0}.to(tl.float16).to(tl.float32)",
        "where": "tl.where({0}, {1}, {2})",
    }  # fmt: skip
    missing = {"uniform": "dropout's numbers are drawn in kernels on CPUs only (the cpu_dropout pass); a GPU "
                          "region keeps ATen's dropout"}


TRITON = TritonOps()

IDENTITY = {("sum", "f32"): "0.0", ("max", "f32"): "float('-inf')", ("min", "f32"): "float('inf')",
            ("sum", "i64"): "0", ("max", "i64"): "-(2**63)", ("min", "i64"): "2**63 - 1",
            ("sum", "i32"): "0", ("max", "i32"): "-(2**31)", ("min", "i32"): "2**31 - 1"}
# Reductions go through tl.reduce with combine functions of the generated module itself, not tl.sum /
# tl.max: those are triton.jit functions decorated when triton was imported, which under
# TRITON_INTERPRET=1 only works if the variable was set before that import.
TL_REDUCE = {"sum": "tl.reduce({0}, {1}, _acc_add)", "max": "tl.reduce({0}, {1}, _acc_max)",
             "min": "tl.reduce({0}, {1}, _acc_min)"}
COMBINE = {"sum": "{a} + {b}", "max": "_acc_max({a}, {b})", "min": "_acc_min({a}, {b})"}
CONSTEXPRS = "BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr"
TORCH_TYPE = {"f32": torch.float32, "i64": torch.int64, "i32": torch.int32}

HEADER = f"""\
import triton
import triton.language as tl

from accelrun.compile.codegen.triton_libdevice import libdevice_for_this_process

libdevice = libdevice_for_this_process()  # Triton's; a numpy stand-in under its interpreter


@triton.jit
def _acc_add(a, b):
    return a + b


@triton.jit
def _acc_max(a, b):
    return {TRITON.op("maximum", "a", "b")}


@triton.jit
def _acc_min(a, b):
    return {TRITON.op("minimum", "a", "b")}
"""


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(tile: int) -> int:
    """Warps of a program instance: about 16 elements of its tile per thread."""
    return max(MIN_WARPS, min(MAX_WARPS, tile // 512))


@dataclass(frozen=True)
class ColsSplit:
    """How a column reduction is cut: ``chunks`` programs per column block each reduce ``rows_per_chunk``
    rows into a partial row of an fp32 (or integer) scratch buffer; with ``chunks > 1`` a second,
    small kernel (``<name>_final``) reduces the partials in a fixed order and runs the epilogue."""

    block_r: int
    block_n: int
    col_blocks: int
    chunks: int
    rows_per_chunk: int


def cols_split(kernel: Kernel) -> ColsSplit:
    block_n = min(_pow2(kernel.trips), COLS_BLOCK_N)
    block_r = max(1, min(_pow2(kernel.rows), TILE_ELEMENTS // block_n))
    col_blocks = -(-kernel.trips // block_n)
    row_tiles = -(-kernel.rows // block_r)
    wanted = max(1, -(-TARGET_PROGRAMS // col_blocks))
    per_chunk = max(MIN_TILES_PER_CHUNK, -(-row_tiles // wanted))
    chunks = -(-row_tiles // per_chunk)
    if chunks == 1:
        per_chunk = row_tiles
    return ColsSplit(block_r, block_n, col_blocks, chunks, per_chunk * block_r)


def looped(kernel: Kernel) -> bool:
    """True when a kernel's row reductions walk the row in chunks (rows longer than ``MAX_ROW``)."""
    return kernel.kind == "rows" and kernel.has_reductions and kernel.trips > MAX_ROW


def tiles(kernel: Kernel) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_N) of a kernel: whole rows when it reduces them, up to ``MAX_ROW``."""
    if kernel.kind == "cols":
        split = cols_split(kernel)
        return split.block_r, split.block_n
    if looped(kernel):
        return 1, LOOP_BLOCK_N
    if kernel.has_reductions:
        block_n = _pow2(kernel.trips)
    else:
        block_n = min(_pow2(kernel.trips), 1024)
    block_r = max(1, min(_pow2(kernel.rows), TILE_ELEMENTS // block_n))
    return block_r, block_n


def blocks_per_axis(kernel: Kernel) -> tuple[int, int]:
    """A rows kernel's tiles: (row blocks, column blocks); a looped kernel has one column block."""
    block_r, block_n = tiles(kernel)
    return -(-kernel.rows // block_r), 1 if looped(kernel) else -(-kernel.trips // block_n)


def grid(kernel: Kernel) -> tuple[int, ...]:
    """The launch grid. A rows kernel's tiles are numbered along axis 0 (column blocks fastest), so
    neither many rows nor a long 1-d tensor's column blocks meet axis 1's limit of 65,535."""
    if kernel.kind == "cols":
        split = cols_split(kernel)
        return _checked((split.col_blocks, split.chunks))
    row_blocks, col_blocks = blocks_per_axis(kernel)
    return _checked((row_blocks * col_blocks,))


def _checked(g: tuple[int, ...]) -> tuple[int, ...]:
    if any(n > limit for n, limit in zip(g, MAX_GRID, strict=False)):
        raise Unsupported(f"launch grid {list(g)} exceeds CUDA's limits {list(MAX_GRID)}")
    return g


@dataclass(frozen=True)
class Launch:
    """One kernel launch of ``launch()``: the kernel's name, grid, buffer arguments and constexprs."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple[str, ...]
    block_r: int
    block_n: int
    num_warps: int
    num_stages: int | None = None  # software pipelining of loops; None: Triton's default (launch_tuning sets it)
    # Runtime rows (``codegen.runtime_rows``): the integers passed after the buffers, each a Python
    # expression of the call's row count ``n_rows`` (the kernel's own parameter names), and the grid as
    # one; ``grid`` then holds the made-up count's, for the cross-compile only.
    scalars: tuple[tuple[str, str], ...] = ()
    grid_expr: str | None = None

    def options(self) -> dict[str, int]:
        """The launch's keyword arguments besides the buffers (constexprs, warps, stages)."""
        out = {"BLOCK_R": self.block_r, "BLOCK_N": self.block_n, "num_warps": self.num_warps}
        return out if self.num_stages is None else {**out, "num_stages": self.num_stages}


@dataclass(frozen=True)
class Scratch:
    """A buffer a region needs only while its kernels run (a split reduction's partials)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def launches(program: LoopProgram) -> list[Launch]:
    out = []
    for kernel in program.kernels:
        block_r, block_n = tiles(kernel)
        args = tuple(_kernel_buffers(kernel.blocks, program.buffers))
        axis = runtime_axis(program, kernel)
        name = kernel_name(kernel, axis)
        scalars, grid_expr = runtime_launch(program, kernel)
        if kernel.kind == "cols" and cols_split(kernel).chunks > 1:
            split = cols_split(kernel)
            loop, *post = kernel.blocks
            parts = tuple(_part_name(kernel, red) for red in loop.reductions)
            loop_args = tuple(_kernel_buffers([loop], program.buffers)) + parts
            out.append(Launch(name, grid(kernel), loop_args, block_r, block_n, _warps(block_r * block_n),
                              scalars=scalars, grid_expr=grid_expr))
            final_r = max(1, min(_pow2(split.chunks), TILE_ELEMENTS // block_n))
            used = _chunks_used(kernel) if axis else None
            out.append(Launch(f"{name}_final", (split.col_blocks,),
                              parts + tuple(_kernel_buffers(post, program.buffers)), final_r, block_n,
                              _warps(final_r * block_n), scalars=(("n_chunks", used),) if used else ()))
            continue
        warps = _warps(block_r * block_n)
        out.append(Launch(name, grid(kernel), args, block_r, block_n, warps, scalars=scalars, grid_expr=grid_expr))
    return out


def runtime_axis(program: LoopProgram, kernel: Kernel) -> str | None:
    """Where a kernel meets the call's row count (``codegen.runtime_rows``): its rows ("rows"), its one
    flat loop over n times a row's elements ("flat"), or nowhere (None)."""
    rows = program.runtime_rows
    if rows is None:
        return None
    return "rows" if kernel.name in rows.kernels else "flat" if kernel.name in rows.flat_kernels else None


def runtime_launch(program: LoopProgram, kernel: Kernel) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """A runtime-rows kernel's integer arguments and grid, as expressions of ``n_rows``; ((), None) for
    a kernel of fixed sizes. Tiles are the made-up count's (a full tile of rows): only how many there
    are changes. A column reduction takes as many chunks as the rows fill, up to the made-up count's
    (its partials' scratch has that many rows), and the rows each chunk sums, in whole tiles; its
    final stage reads that many partials."""
    axis = runtime_axis(program, kernel)
    if axis is None:
        return (), None
    block_r, block_n = tiles(kernel)
    if kernel.kind == "cols":
        split = cols_split(kernel)
        used = _chunks_used(kernel) if split.chunks > 1 else "1"
        per_chunk = f"triton.cdiv(triton.cdiv(n_rows, {used}), {block_r}) * {block_r}"
        grid_expr = f"({split.col_blocks}, {used})" if split.chunks > 1 else None
        values = ("n_rows", per_chunk)
    elif axis == "flat":  # one row of n_rows times its elements: column blocks only
        values, grid_expr = ("n_rows",), f"(max(1, triton.cdiv(n_rows * {_flat_width(kernel)}, {block_n})),)"
    else:
        col_blocks = 1 if looped(kernel) else -(-kernel.trips // block_n)
        values, grid_expr = ("n_rows",), f"(max(1, triton.cdiv(n_rows, {block_r})) * {col_blocks},)"
    return tuple(zip(runtime_params(kernel, axis), values, strict=True)), grid_expr


def runtime_params(kernel: Kernel, axis: str | None) -> tuple[str, ...]:
    """The integer parameters a runtime-rows kernel takes after its buffers (none for fixed sizes): the
    call's row count, and a column reduction's rows per chunk."""
    if axis is None:
        return ()
    return ("n_rows", "rows_per_chunk") if kernel.kind == "cols" and axis == "rows" else ("n_rows",)


def _chunks_used(kernel: Kernel) -> str:
    """A runtime-rows column reduction's chunks for the call's rows (an expression of ``n_rows``)."""
    split = cols_split(kernel)
    return f"max(1, min({split.chunks}, triton.cdiv(n_rows, {split.block_r})))"


def _flat_width(kernel: Kernel) -> int:
    """A flat kernel's trips per row of the runtime count (its columns past the first axis, unrolled)."""
    return math.prod(kernel.col_shape[1:]) // kernel.unroll


def scratch_buffers(program: LoopProgram) -> list[Scratch]:
    out = []
    for kernel in program.kernels:
        if kernel.kind == "cols" and cols_split(kernel).chunks > 1:
            for red in kernel.blocks[0].reductions:
                out.append(Scratch(_part_name(kernel, red), (cols_split(kernel).chunks, kernel.trips),
                                   TORCH_TYPE[red.ctype]))
    return out


def _part_name(kernel: Kernel, red: Reduction) -> str:
    return f"{kernel.name}_{red.name}_part"


def kernel_name(kernel: Kernel, runtime: str | None = None) -> str:
    """The ``@triton.jit`` function's name, what profilers show: kind and domain, e.g.
    ``kernel1_cols_8192x1024`` (the name depends on the program only, so equal regions share a module);
    ``n`` for the count a runtime-rows kernel reads at each call (``kernel1_rows_nx48``)."""
    if runtime == "rows":
        return f"{kernel.name}_{kernel.kind}_nx{kernel.cols}"
    if runtime == "flat":
        return f"{kernel.name}_{kernel.kind}_1xn{_flat_width(kernel) * kernel.unroll}"
    return f"{kernel.name}_{kernel.kind}_{kernel.rows}x{kernel.cols}"


def triton_source(program: LoopProgram) -> str:
    for buf in program.buffers:
        if _numel(buf) >= 2**31:
            raise Unsupported("tensors of 2**31 elements or more (Triton indices are 32-bit here)")
    _check_runtime_rows(program)
    e = Emitter()
    e.lines(HEADER)
    for kernel in program.kernels:
        e.line()
        e.line()
        _KernelWriter(e, kernel, program.buffers, runtime_axis(program, kernel)).write()
    names = [b.name for b in program.buffers] + [s.name for s in scratch_buffers(program)]
    names += ["n_rows"] if program.runtime_rows is not None else []
    e.line()
    e.line()
    with e.block(f"def launch({', '.join(names)}):"):
        for ln in launches(program):
            args = [*ln.args, *(value for _, value in ln.scalars)]
            e.line(f"{ln.kernel}[{ln.grid_expr or ln.grid}]({', '.join(args)}, BLOCK_R={ln.block_r}, "
                   f"BLOCK_N={ln.block_n}, num_warps={ln.num_warps})")
        if not program.kernels:
            e.line("pass")
    return e.source()


def _check_runtime_rows(program: LoopProgram) -> None:
    """What of a size read at each call the Triton generator does not write (the region then stays in
    another executor, with this reason)."""
    if program.linear_sizes is not None:
        raise Unsupported("sizes that follow a length read at each call (a·s + b): Triton kernels take "
                          "fixed sizes or a row count read at each call")
    if program.size_inputs and program.runtime_rows is None:
        raise Unsupported("a size among the region's inputs (triton kernels take tensors only)")
    for k in program.kernels:
        if runtime_axis(program, k) == "flat" and k.has_reductions:
            raise Unsupported("a reduction over all n·k elements of a changing size (the Triton generator "
                              "reads a changing row count, not a changing reduction length)")


def _numel(buf: Buffer) -> int:
    n = 1
    for s in buf.shape:
        n *= s
    return n


def _kernel_buffers(blocks: list[Block], buffers: list[Buffer]) -> list[str]:
    used = set()
    for b in blocks:
        used |= {s.args[0] for s in b.stmts if s.op == "load"} | {s.buffer for s in b.stores}
    return [b.name for b in buffers if b.name in used]


class _KernelWriter:
    def __init__(self, e: Emitter, kernel: Kernel, buffers: list[Buffer], runtime: str | None = None) -> None:
        self.e, self.k = e, kernel
        # Bounds as the kernel's code reads them: literals, or for runtime rows (``runtime``) its
        # ``n_rows`` parameter (the rows, or a flat kernel's trips in n_rows times its width).
        self.runtime = runtime
        self.row_bound = "n_rows" if runtime == "rows" else str(kernel.rows)
        self.trip_bound = f"n_rows * {_flat_width(kernel)}" if runtime == "flat" else str(kernel.trips)
        self.name = kernel_name(kernel, runtime)
        self.params = ", ".join([*runtime_params(kernel, runtime), CONSTEXPRS])
        self.buffers = {b.name: b for b in buffers}
        # A row buffer needs no memory here: a kernel with row reductions holds whole rows in its tile,
        # so the value an earlier block keeps is still a live variable.
        self.rows = {b.name for b in kernel.row_buffers}
        self.all_buffers = buffers
        self.pairs = _PairedAccess(None)  # set while writing a rows kernel that has interleaved pairs

    def write(self) -> None:
        e, k = self.e, self.k
        if k.kind == "cols":
            self._write_cols()
            return
        if looped(k):
            self._write_looped()
            return
        args = _kernel_buffers(k.blocks, self.all_buffers)
        row_blocks, col_blocks = blocks_per_axis(k)
        if self.runtime == "rows":  # as many row blocks as the call's rows need
            row_blocks = 2
        elif self.runtime == "flat":
            col_blocks = 2
        e.line("@triton.jit")
        with e.block(f"def {self.name}({', '.join(args)}, {self.params}):"):
            row_block, col_block = "tl.program_id(0)", "tl.program_id(0)"
            if col_blocks > 1 and row_blocks > 1:
                row_block, col_block = f"(tl.program_id(0) // {col_blocks})", f"(tl.program_id(0) % {col_blocks})"
            r0 = f"{row_block} * BLOCK_R + " if row_blocks > 1 else ""
            c0 = f"{col_block} * BLOCK_N + " if col_blocks > 1 else ""
            e.line(f"r = {self._wide('rows', f'{r0}tl.arange(0, BLOCK_R)[:, None]')}")
            e.line(f"c = {self._wide('flat', f'{c0}tl.arange(0, BLOCK_N)[None, :]')}")
            e.line(f"rmask = r < {self.row_bound}")
            e.line(f"mask = rmask & (c < {self.trip_bound})")
            e.line("zero_outer = r * 0")
            e.line("zero_inner = r * 0 + c * 0")
            self.pairs = _PairedAccess(k)
            if self.pairs:
                e.line(f"c2 = {c0.replace(' * BLOCK_N + ', ' * 2 * BLOCK_N + ')}tl.arange(0, 2 * BLOCK_N)[None, :]")
                e.line(f"mask2 = rmask & (c2 < 2 * ({self.trip_bound}))")
                e.line("zero2 = r * 0 + c2 * 0")
            for block in k.blocks:
                level = "inner" if block.level == "inner" else "outer"
                mask = "mask" if level == "inner" else "rmask"
                self._stmts(block.stmts, mask, f"zero_{level}")
                for red in block.reductions:
                    init = IDENTITY[red.op, red.ctype]
                    full = f"tl.where(mask, {red.value} + zero_inner.to({TL_TYPE[red.ctype]}), {init})"
                    e.line(f"{red.name} = {TL_REDUCE[red.op].format(full, 1)}[:, None]")
                self._stores(block, mask, f"zero_{level}")

    def _wide(self, axis: str, index: str) -> str:
        """``index`` as 64-bit where it counts the call's rows (``axis`` "rows") or a flat kernel's
        elements ("flat") of a runtime-rows kernel: the build checked 2**31 elements at the made-up
        count only, and a call may hold more (a changing length over a 128k vocabulary)."""
        return f"({index}).to(tl.int64)" if self.runtime == axis else index

    def _write_looped(self) -> None:
        """Rows longer than one tile: each inner block is a loop over the row, ``BLOCK_N`` columns a
        step, folding its reductions into ``[BLOCK_R, BLOCK_N]`` partials that are reduced across the
        tile after the loop. Registers stay bounded by the chunk, whatever the row's length. A value
        the loop IR keeps in a row buffer for a later pass is recomputed there (the row is not held)."""
        e, k = self.e, self.k
        args = _kernel_buffers(k.blocks, self.all_buffers)
        sources = {st.buffer: (b, st.value) for b in k.blocks for st in b.stores if st.buffer in self.rows}
        e.line("@triton.jit")
        with e.block(f"def {self.name}({', '.join(args)}, {self.params}):"):
            e.line(f"r = {self._wide('rows', 'tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]')}")
            e.line(f"rmask = r < {self.row_bound}")
            e.line("zero_outer = r * 0")
            pairs = online_pairs(k)
            done: set[int] = set()
            for i, block in enumerate(k.blocks):
                if i in done:
                    continue
                if block.level != "inner":
                    self._stmts(block.stmts, "rmask", "zero_outer")
                    self._stores(block, "rmask", "zero_outer")
                    continue
                pair = pairs.get(i)
                second = [k.blocks[pair.second]] if pair is not None else []
                self._row_loop([block, *second], sources, pair)
                for red in block.reductions:
                    e.line(f"{red.name} = {TL_REDUCE[red.op].format(red.name + '_part', 1)}[:, None]")
                if pair is None:
                    continue
                # The blocks between (per-row values from the max: the shift k), then the sum, rescaled.
                for between in k.blocks[i + 1 : pair.second]:
                    self._stmts(between.stmts, "rmask", "zero_outer")
                    self._stores(between, "rmask", "zero_outer")
                m, total = pair.max_red.name, pair.sum_red.name
                lanes = f"tl.where({m}_part == float('-inf'), 0.0, {total}_part * tl.exp({_finite(m + '_part')} - {pair.shift}))"
                e.line(f"{total} = {TL_REDUCE['sum'].format(lanes, 1)}[:, None]")
                # k = -inf: the row's max is -inf, every element too, and eager's exp(-inf - -inf) is NaN.
                e.line(f"{total} = tl.where({pair.shift} == float('-inf'), float('nan'), {total})")
                for red in second[0].reductions:
                    if red is not pair.sum_red:
                        e.line(f"{red.name} = {TL_REDUCE[red.op].format(red.name + '_part', 1)}[:, None]")
                done |= set(range(i + 1, pair.second + 1))

    def _row_loop(self, blocks: list[Block], sources: dict[str, tuple[Block, str]], pair: OnlinePair | None) -> None:
        """One loop over the row for ``blocks`` (one inner block, or an online pair): their statements,
        their reductions folded into partial tiles, their stores."""
        e = self.e
        for red in (red for b in blocks for red in b.reductions):
            e.line(f"{red.name}_part = tl.full([BLOCK_R, BLOCK_N], {IDENTITY[red.op, red.ctype]}, {TL_TYPE[red.ctype]})")
        with e.block(f"for c0 in range(0, {self.trip_bound}, BLOCK_N):"):
            e.line(f"c = {self._wide('flat', 'c0 + tl.arange(0, BLOCK_N)[None, :]')}")
            e.line(f"mask = rmask & (c < {self.trip_bound})")
            e.line("zero_inner = r * 0 + c * 0")
            emitted: set[str] = set()
            for st in blocks[0].stmts:
                self._recompute(st.name, blocks[0], sources, emitted)
            if pair is not None:
                # The second block's copy of the max's value is that value; its x - k and exp(x - k)
                # wait for k, after the loop.
                e.line(f"{pair.same} = {pair.max_red.value}")
                emitted |= {pair.same, *pair.skipped}
                for st in blocks[1].stmts:
                    self._recompute(st.name, blocks[1], sources, emitted)
            for red in (red for b in blocks for red in b.reductions):
                init = IDENTITY[red.op, red.ctype]
                value = f"tl.where(mask, {red.value} + zero_inner.to({TL_TYPE[red.ctype]}), {init})"
                if pair is not None and red is pair.sum_red:
                    continue
                if pair is not None and red is pair.max_red:
                    m, total = red.name, pair.sum_red.name
                    e.line(f"{m}_new = " + COMBINE["max"].format(a=f"{m}_part", b=value))
                    e.line(f"{m}_shift = {_finite(m + '_new')}")
                    e.line(f"{total}_part = tl.where({m}_part == float('-inf'), 0.0, {total}_part * "
                           f"tl.exp({_finite(m + '_part')} - {m}_shift)) + "
                           f"tl.where(mask, tl.exp({red.value} - {m}_shift), 0.0)")
                    e.line(f"{m}_part = {m}_new")
                    continue
                e.line(f"{red.name}_part = " + COMBINE[red.op].format(a=f"{red.name}_part", b=value))
            for b in blocks:
                self._stores(b, "mask", "zero_inner", keep_rows=False)

    def _recompute(self, name: str, block: Block, sources: dict[str, tuple[Block, str]], emitted: set[str]) -> None:
        """Emit the statement of ``block`` that defines ``name``, after those it needs; a load from a
        row buffer becomes the statements of the earlier block that computed the stored value."""
        if name in emitted:
            return
        stmt = next((st for st in block.stmts if st.name == name), None)
        if stmt is None:
            return  # a per-row value (or a finished reduction): live in the whole kernel
        emitted.add(name)
        if stmt.op == "load" and stmt.args[0] in self.rows:
            earlier, value = sources[stmt.args[0]]
            self._recompute(value, earlier, sources, emitted)
            self.e.line(f"{name} = {value}")
            return
        if stmt.op not in ("load", "const", "index"):
            for arg in stmt.args:
                if isinstance(arg, str):
                    self._recompute(arg, block, sources, emitted)
        self.e.line(f"{name} = {self._expr(stmt, 'mask', 'zero_inner')}")

    def _write_cols(self) -> None:
        """A column reduction: each program takes ``BLOCK_N`` columns and a chunk of the rows, folding
        ``BLOCK_R x BLOCK_N`` tiles into a tile of accumulators, then reducing that over its rows."""
        e, k = self.e, self.k
        split = cols_split(k)
        loop, *post = k.blocks
        two_stage = split.chunks > 1
        parts = [_part_name(k, red) for red in loop.reductions]
        args = _kernel_buffers([loop], self.all_buffers) + parts if two_stage else \
            _kernel_buffers(k.blocks, self.all_buffers)
        # A chunk's rows: fixed, or for runtime rows the launch's rows_per_chunk (whole tiles)
        per_chunk = "rows_per_chunk" if self.runtime == "rows" else str(split.rows_per_chunk)
        e.line("@triton.jit")
        with e.block(f"def {self.name}({', '.join(args)}, {self.params}):"):
            e.line("c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
            e.line(f"cmask = c < {k.trips}")
            e.line("zero_col = c * 0")
            first = f"tl.program_id(1) * {per_chunk} + " if two_stage else ""
            for red in loop.reductions:
                e.line(f"{red.name}_part = tl.full([BLOCK_R, BLOCK_N], {IDENTITY[red.op, red.ctype]}, "
                       f"{TL_TYPE[red.ctype]})")
            with e.block(f"for r0 in range(0, {per_chunk}, BLOCK_R):"):
                e.line(f"r = {self._wide('rows', f'{first}r0 + tl.arange(0, BLOCK_R)[:, None]')}")
                e.line(f"mask = (r < {self.row_bound}) & cmask")
                e.line("zero_inner = r * 0 + c * 0")
                self._stmts(loop.stmts, "mask", "zero_inner")
                for red in loop.reductions:
                    init = IDENTITY[red.op, red.ctype]
                    value = f"tl.where(mask, {red.value} + zero_inner.to({TL_TYPE[red.ctype]}), {init})"
                    e.line(f"{red.name}_part = " + COMBINE[red.op].format(a=f"{red.name}_part", b=value))
            for red in loop.reductions:
                e.line(f"{red.name} = {TL_REDUCE[red.op].format(red.name + '_part', 0)}[None, :]")
            if not two_stage:
                self._epilogue(post)
                return
            for red, part in zip(loop.reductions, parts, strict=True):
                ptr = f"{part} + tl.program_id(1) * {k.trips} + c + zero_col"
                e.line(f"tl.store({ptr}, {red.name}, mask=cmask)")
        e.line()
        e.line()
        # The second stage: the partials of every chunk, reduced in chunk order (deterministic).
        args = parts + _kernel_buffers(post, self.all_buffers)
        e.line("@triton.jit")
        chunks = "n_chunks" if self.runtime == "rows" else str(split.chunks)  # the partials the first stage wrote
        params = f"n_chunks, {CONSTEXPRS}" if self.runtime == "rows" else CONSTEXPRS
        with e.block(f"def {self.name}_final({', '.join(args)}, {params}):"):
            e.line("c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
            e.line(f"cmask = c < {k.trips}")
            e.line("zero_col = c * 0")
            for red in loop.reductions:
                e.line(f"{red.name}_part = tl.full([BLOCK_R, BLOCK_N], {IDENTITY[red.op, red.ctype]}, "
                       f"{TL_TYPE[red.ctype]})")
            with e.block(f"for p0 in range(0, {chunks}, BLOCK_R):"):
                e.line("p = p0 + tl.arange(0, BLOCK_R)[:, None]")
                e.line(f"pmask = (p < {chunks}) & cmask")
                for red, part in zip(loop.reductions, parts, strict=True):
                    init = IDENTITY[red.op, red.ctype]
                    value = f"tl.load({part} + p * {k.trips} + c, mask=pmask, other={init})"
                    e.line(f"{red.name}_part = " + COMBINE[red.op].format(a=f"{red.name}_part", b=value))
            for red in loop.reductions:
                e.line(f"{red.name} = {TL_REDUCE[red.op].format(red.name + '_part', 0)}[None, :]")
            self._epilogue(post)

    def _epilogue(self, post: list[Block]) -> None:
        for block in post:
            self._stmts(block.stmts, "cmask", "zero_col")
            self._stores(block, "cmask", "zero_col")

    def _stmts(self, stmts: list[Stmt], mask: str, zero: str) -> None:
        for s in stmts:
            pair = self.pairs.of(s)
            if pair is None:
                self.e.line(f"{s.name} = {self._expr(s, mask, zero)}")
            elif pair:  # the first of the two: one contiguous load, split into even and odd elements
                even, odd, buf, base = pair
                self.e.line(f"{even.name}_{odd.name} = tl.load({buf} + {print_index(base, 'triton')} + c2 + zero2, "
                            "mask=mask2, other=0)")
                self.e.line(f"{even.name}, {odd.name} = tl.split(tl.reshape({even.name}_{odd.name}, "
                            "[BLOCK_R, BLOCK_N, 2]))")
                self.e.line(f"{even.name} = {even.name}.to({TL_TYPE[even.ctype]})")
                self.e.line(f"{odd.name} = {odd.name}.to({TL_TYPE[odd.ctype]})")

    def _expr(self, s: Stmt, mask: str, zero: str) -> str:
        if s.op == "load" and s.args[0] in self.rows:
            return s.args[0]
        if s.op == "load":
            buf = self.buffers[s.args[0]]
            ptr = f"{buf.name} + {print_index(s.args[1], 'triton')} + {zero}"
            return f"tl.load({ptr}, mask={mask}, other=0).to({TL_TYPE[s.ctype]})"
        if s.op == "const":
            return f"tl.full([1, 1], {_literal(s.args[0], s.ctype)}, {TL_TYPE[s.ctype]})"
        if s.op == "index":
            return f"({print_index(s.args[0], 'triton')} + {zero})"
        if s.op == "cast":
            return f"{s.args[0]}.to({TL_TYPE[s.ctype]})"
        expr = TRITON.op(s.op, *s.args)
        return f"({expr}).to({TL_TYPE[s.ctype]})" if s.op == "sign" else expr

    def _stores(self, block: Block, mask: str, zero: str, keep_rows: bool = True) -> None:
        for st in block.stores:
            if st.buffer in self.rows:
                if keep_rows:
                    self.e.line(f"{st.buffer} = {st.value}")
                continue
            buf = self.buffers[st.buffer]
            pair = self.pairs.of(st)
            if pair is False:
                continue  # stored with its partner
            if pair is not None:  # even and odd elements interleaved, one contiguous store
                even, odd, _, base = pair
                t = STORAGE[buf.storage]
                both = (f"tl.join(tl.broadcast_to({even.value}, [BLOCK_R, BLOCK_N]).to({t}), "
                        f"tl.broadcast_to({odd.value}, [BLOCK_R, BLOCK_N]).to({t}))")
                self.e.line(f"tl.store({buf.name} + {print_index(base, 'triton')} + c2 + zero2, "
                            f"tl.reshape({both}, [BLOCK_R, 2 * BLOCK_N]), mask=mask2)")
                continue
            ptr = f"{buf.name} + {print_index(st.index, 'triton')} + {zero}"
            self.e.line(f"tl.store({ptr}, {st.value}.to({STORAGE[buf.storage]}), mask={mask})")


class _PairedAccess:
    """Loads and stores of a rows kernel that touch a buffer's elements ``2c + k`` and ``2c + k + 1``
    (an interleaved pair: RoPE on (real, imaginary) pairs, a view of a last axis as ``(n, 2)``).
    Two stride-2 accesses make every warp touch each cache line twice with two-byte requests; on an
    H100 such a RoPE kernel ran 10x slower than one contiguous load of ``2 * BLOCK_N`` elements
    split into even and odd halves in registers (and the mirror for stores: join, then one store)."""

    def __init__(self, kernel: Kernel | None) -> None:
        # id(access) → (even, odd, buffer, base) for the first of a pair in program order, False for
        # the second (emitted with the first).
        self.pairs: dict[int, tuple[Any, Any, str, Any] | bool] = {}
        if kernel is None or kernel.kind != "rows" or looped(kernel):
            return
        for block in kernel.blocks:
            if block.level == "inner":
                self._pair([(s.args[0], s.args[1], s) for s in block.stmts if s.op == "load"])
                self._pair([(st.buffer, st.index, st) for st in block.stores])

    def _pair(self, accesses: list[tuple[str, Any, Any]]) -> None:
        """Pairs among ``(buffer, index, access)`` in program order (loads of one dtype; stores)."""
        by_element = {}
        for buf, index, access in accesses:
            if (base := _pair_base(index)) is not None:
                by_element[buf, base] = access
        order = {id(access): i for i, (_, _, access) in enumerate(accesses)}
        for (buf, base), even in by_element.items():
            odd = by_element.get((buf, base + 1))
            # (buf, base - 1) taken: base is an odd element of the pair before it
            if odd is None or (buf, base - 1) in by_element or getattr(even, "ctype", None) != getattr(odd, "ctype", None):
                continue
            first, second = sorted((even, odd), key=lambda a: order[id(a)])
            self.pairs[id(first)] = (even, odd, buf, base)
            self.pairs[id(second)] = False

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def of(self, access: Stmt | Store) -> tuple[Any, Any, str, Any] | bool | None:
        """The pair ``access`` begins, False if it ends one, None if it is not paired."""
        return self.pairs.get(id(access))


def _pair_base(index: Any) -> Any:
    """``e0`` when ``index`` is ``2 * c + e0`` with ``e0`` free of ``c`` (a pair's even element), else None."""
    index = sympy.sympify(index)
    if C not in index.free_symbols:
        return None
    base = index.subs(C, 0)
    if sympy.expand(index - base) != 2 * C:
        return None
    return base


def _finite(m: str) -> str:
    """A running max as the shift of an online sum: 0 where it is infinite (no inf - inf)."""
    return f"tl.where(tl.abs({m}) == float('inf'), 0.0, {m})"


def _literal(value: Any, ctype: str) -> str:
    if ctype == "bool":
        return "1" if value else "0"
    if ctype != "f32":
        return str(int(value))
    if value != value:
        return "float('nan')"
    if value in (float("inf"), float("-inf")):
        return "float('inf')" if value > 0 else "float('-inf')"
    return repr(float(value))


def default_cache_dir() -> Path:
    root = os.environ.get("ACCELRUN_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "accelrun"
    return base / "compile" / "triton"


def module_path(source: str, cache_dir: str | os.PathLike | None = None) -> Path:
    key = hashlib.sha256(source.encode()).hexdigest()
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return directory / f"accelrun_{key[:32]}.py"


def load_module(source: str, cache_dir: str | os.PathLike | None = None) -> Any:
    """Import the generated module from ``<cache_dir>/<sha256>.py`` (written atomically)."""
    path = module_path(source, cache_dir)
    key = path.stem.removeprefix("accelrun_")
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = directory / f".{path.name}.{os.getpid()}.tmp"
        tmp.write_text(source)
        os.replace(tmp, path)
    name = f"accelrun_triton_{key}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

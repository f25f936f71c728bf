"""C++/OpenMP for a ``LoopProgram``: one function per kernel, one entry point that runs them in order.

Rows are split across threads (``#pragma omp parallel for``) when a kernel has enough work to pay
for waking them; the loop over a row is ``#pragma omp simd`` so g++ vectorizes it, reductions
included (the pragma allows reassociating a sum; float max/min go through declared reductions that
keep a NaN, as eager does). A kernel's row buffers are arrays on the thread's stack, one row long.
exp, erf, 1 + erf and tanh are branch-free polynomials (``acc_exp``, ``acc_erf``, ``acc_one_plus_erf``,
``acc_tanh``) so that loops
calling them still vectorize; bf16 is widened and rounded with bit shifts.

    source = cpp_source(program)
    fn = CppRegion(program, build_and_load(source, cache_dir))
    outputs = fn(*inputs)
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import Any

import torch

from accelrun.compile.codegen.cached_files import found
from accelrun.compile.codegen.cpp_build import load_library
from accelrun.compile.codegen.emitter import Emitter
from accelrun.compile.codegen.exp_poly import EXP_CORE
from accelrun.compile.codegen.index_print import print_index
from accelrun.compile.codegen.loop_ir import (
    Block,
    Buffer,
    C,
    Kernel,
    LoopProgram,
    Reduction,
    Stmt,
    Unsupported,
    contiguous_strides,
)
from accelrun.compile.codegen.math_poly import FUNCTIONS as POLYNOMIAL_FUNCTIONS
from accelrun.compile.codegen.ops import INFIX, Renderer
from accelrun.compile.codegen.runtime_rows import leads_with
from accelrun.compile.fused import dropout
from accelrun.torch_private import TensorGuards, empty_strided_cpu

ENTRY = "accelrun_region"
PARALLEL_MIN_ELEMENTS = 1 << 15  # below this, starting threads costs more than it saves
CHUNK = 4096  # long rows of a pointwise kernel are split into chunks so every thread gets work

CTYPE = {"f32": "float", "i64": "int64_t", "i32": "int32_t", "bool": "bool"}
STORAGE = {"f32": "float", "bf16": "uint16_t", "i64": "int64_t", "i32": "int32_t", "i16": "int16_t",
           "i8": "int8_t", "u8": "uint8_t", "bool": "bool"}

class CppOps(Renderer):
    name = "C++"
    one = "1.0f"
    primitives = {
        **INFIX, "and": "({0} && {1})", "or": "({0} || {1})", "not": "(!{0})", "pow": "__builtin_powf({0}, {1})",
        "abs": "__builtin_fabsf({0})", "exp": "acc_exp({0})", "log": "__builtin_logf({0})",
        "log1p": "__builtin_log1pf({0})", "expm1": "__builtin_expm1f({0})", "tanh": "acc_tanh({0})",
        "sqrt": "__builtin_sqrtf({0})", "erf": "acc_erf({0})", "one_plus_erf": "acc_one_plus_erf({0})",
        "sin": "__builtin_sinf({0})",
        "cos": "__builtin_cosf({0})", "floor": "__builtin_floorf({0})", "ceil": "__builtin_ceilf({0})",
        "trunc": "__builtin_truncf({0})", "sign": "(({0} > 0) - ({0} < 0))", "round_bf16": "bf16_round({0})",
        "where": "({0} ? {1} : {2})", "uniform": "acc_uniform({0}, {1})",
    }  # fmt: skip
    missing = {"round_f16": "float16 tensors have no C++ storage type here; such regions are declined earlier"}


CPP = CppOps()

REDUCE_INIT = {("sum", "f32"): "0.0f", ("max", "f32"): "-INFINITY", ("min", "f32"): "INFINITY",
               ("sum", "i64"): "0", ("max", "i64"): "INT64_MIN", ("min", "i64"): "INT64_MAX",
               ("sum", "i32"): "0", ("max", "i32"): "INT32_MIN", ("min", "i32"): "INT32_MAX"}
# Integer ops whose float forms above would round: computed exactly (integer pow is left to ATen).
INT_OPS = {"abs": "({0} < 0 ? -{0} : {0})"}
# max/min reduce with the table's NaN-propagating maximum/minimum (OpenMP's own max/min need not keep a
# NaN): acc_nanmax/acc_nanmin are declared in the prelude from the same ops.
REDUCE_OP = {"max": "maximum", "min": "minimum"}
OMP_REDUCE = {"sum": "+", "max": "max", "min": "min"}
OMP_REDUCE_F32 = {"sum": "+", "max": "acc_nanmax", "min": "acc_nanmin"}


# fp32 sums are taken in partials of this many terms (rows, in a kernel that sums over rows): error grows
# with the length of the sum (ATen's cascade sum keeps it flat)
SUM_BLOCK = 4096


def _blocked(red: Reduction) -> bool:
    return red.op == "sum" and red.ctype == "f32"


def _update(op: str, acc: str, value: str) -> str:
    if op == "sum":
        return f"{acc} += {value};"
    return f"{acc} = {CPP.op(REDUCE_OP[op], value, acc)};"


def _omp_declare(name: str, op: str, identity: str) -> str:
    return (f"#pragma omp declare reduction({name} : float : omp_out = {CPP.op(op, 'omp_in', 'omp_out')}) "
            f"initializer(omp_priv = {identity})")


# Only <stdint.h> and <omp.h>: <cmath>, <algorithm> and <vector> took 0.2-0.3 s of g++ time per
# library to parse, more than most kernels take to compile. Math goes through GCC's builtins.
PRELUDE = r"""
#include <stdint.h>
#include <omp.h>

#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#ifndef NAN
#define NAN __builtin_nanf("")
#endif
static inline int64_t acc_min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t acc_max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    return static_cast<uint16_t>(f != f ? 0x7fc0u : rounded);
}
static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }
// c ? a : b as a select of bits (exactly a or b), both read.
static inline float acc_pick(bool c, float a, float b) {
    uint32_t ua, ub;
    __builtin_memcpy(&ua, &a, 4);
    __builtin_memcpy(&ub, &b, 4);
    const uint32_t m = 0u - static_cast<uint32_t>(c), u = (ua & m) | (ub & ~m);
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

// max/min reductions that keep a NaN (OpenMP's built-in max/min need not); still vectorized.
{omp_reductions}

{exp_core}
// exp with the range's ends (0 below it, inf above it); codegen/exp_poly.py has the polynomial.
static inline float acc_exp(float x) {
    const float lo = x < ACC_EXP_LO ? ACC_EXP_LO : x;
    const float xc = ACC_EXP_HI < lo ? ACC_EXP_HI : lo;
    const float y = acc_exp_core<float, int32_t>(xc);
    return x < ACC_EXP_LO ? 0.0f : (x > ACC_EXP_HI ? INFINITY : y);
}
{functions}"""
PRELUDE = (PRELUDE.replace("{omp_reductions}", _omp_declare("acc_nanmax", "maximum", "-INFINITY") + "\n"
                           + _omp_declare("acc_nanmin", "minimum", "INFINITY"))
           .replace("{exp_core}", EXP_CORE.strip("\n")).replace("{functions}", POLYNOMIAL_FUNCTIONS + dropout.cpp_source()))


def cpp_source(program: LoopProgram, entry: str = ENTRY, prelude: bool = True) -> str:
    """C++ source defining ``extern "C" void <entry>(void** bufs, int64_t n, int nthreads)``: ``n`` is
    the call's row count where the program has runtime rows (``codegen.runtime_rows``), unused
    otherwise. Sources made with distinct entries and ``prelude=False`` can follow one ``PRELUDE`` in
    a single library."""
    for buf in program.buffers:
        if buf.storage == "f16":
            raise Unsupported("float16 tensors (the cpp generator handles fp32 and bf16)")
    if program.linear_sizes is not None:  # written once for every length (codegen.linear_sizes)
        return (PRELUDE if prelude else "") + program.linear_sizes.source(entry)
    e = Emitter()
    if prelude:
        e.lines(PRELUDE)
    slots = {b.name: n for n, b in enumerate(program.buffers)}
    functions = []
    kernels = list(program.kernels)
    while kernels:
        kernel = kernels.pop(0)
        n_axis = _runtime_axis(program, kernel)
        writer = _KernelWriter(e, kernel, program.buffers, slots, f"{entry}_{kernel.name}", n_axis)
        e.line()
        if kernels and _one_pass(kernel, kernels[0], rows_at_call=n_axis is not None):  # runtime rows: both or neither
            rows = _KernelWriter(e, kernels.pop(0), program.buffers, slots, "", n_axis)
            writer.write(rows_too=rows)
        else:
            writer.write()
        functions.append(writer.fn_name)
    e.line()
    with e.block(f'extern "C" void {entry}(void** bufs, int64_t n, int nthreads) {{', "}"):
        for fn in functions:
            e.line(f"{fn}(bufs, n, nthreads);")
    return e.source()


def _runtime_axis(program: LoopProgram, kernel: Kernel) -> str | None:
    """Where a kernel's loops meet the call's row count ``n``: its leading row axis ("rows"), its
    one loop over columns ("cols"), or nowhere (None)."""
    rows = program.runtime_rows
    if rows is None:
        return None
    return "rows" if kernel.name in rows.kernels else "cols" if kernel.name in rows.flat_kernels else None


def _one_pass(cols: Kernel, rows: Kernel, rows_at_call: bool = False) -> bool:
    """Can a column-reduction kernel run inside the row loop of the rows kernel after it? (a norm's
    backward: its weight gradient and its input gradient read the same rows.) Then each row is read
    from memory once: the column loop's reads leave it in L1 for the row loop. Needs the same domain,
    no value passing between the two, and a row loop that is not cut into column chunks (a pointwise
    rows kernel is, where its rows are longer than ``CHUNK``: a bias's gradient beside the input
    gradient it sums is one pass over the gradient, not two). Rows are the same where their counts
    are (``r`` is the flat row either way), unless the count is the call's (``rows_at_call``): it is
    worked out from the row shape."""
    if cols.kind != "cols" or rows.kind != "rows":
        return False
    if not rows.has_reductions and rows.trips > CHUNK // rows.unroll:
        return False
    same_rows = cols.row_shape == rows.row_shape or (not rows_at_call and cols.rows == rows.rows)
    if not same_rows or (cols.col_shape, cols.unroll) != (rows.col_shape, rows.unroll):
        return False
    return not (_stored(cols) & _loaded(rows)) and not (_stored(rows) & _loaded(cols)) and not rows.row_buffers


def _loaded(k: Kernel) -> set[str]:
    return {s.args[0] for b in k.blocks for s in b.stmts if s.op == "load"}


def _stored(k: Kernel) -> set[str]:
    return {st.buffer for b in k.blocks for st in b.stores}


def _literal(value: Any, ctype: str) -> str:
    if ctype == "bool":
        return "true" if value else "false"
    if ctype != "f32":
        return f"INT64_C({int(value)})" if ctype == "i64" else str(int(value))
    if value != value:
        return "NAN"
    if value in (float("inf"), float("-inf")):
        return "INFINITY" if value > 0 else "-INFINITY"
    return f"{float(value)!r}f"


class _KernelWriter:
    def __init__(self, e: Emitter, kernel: Kernel, buffers: list[Buffer], slots: dict[str, int],
                 fn_name: str, n_axis: str | None = None) -> None:
        self.e, self.k, self.slots, self.fn_name = e, kernel, slots, fn_name
        self.n_axis = n_axis  # where the call's row count n sets a loop's length (_runtime_axis)
        self.buffers = {b.name: b for b in (*buffers, *kernel.row_buffers)}
        self.in_output = rows_kept_in_outputs(kernel, self.buffers)
        self.ctype_of = {s.name: s.ctype for b in kernel.blocks for s in b.stmts}
        self.row_invariant = {s.name for b in kernel.blocks if b.level == "outer" for s in b.stmts}
        self.rows = {b.name for b in kernel.row_buffers}

    def write(self, rows_too: _KernelWriter | None = None) -> None:
        """The kernel as a function; ``rows_too``: a rows kernel run inside this cols kernel's row loop."""
        e, k = self.e, self.k
        used = self._used_buffers() - self.rows
        if rows_too is not None:
            used |= rows_too._used_buffers() - rows_too.rows
            self.buffers |= rows_too.buffers
        with e.block(f"static void {self.fn_name}(void** bufs, int64_t n, int nthreads) {{", "}"):
            for name in sorted(used, key=self.slots.__getitem__):
                buf = self.buffers[name]
                const = "const " if buf.role == "input" else ""
                e.line(f"{const}{STORAGE[buf.storage]}* __restrict__ {name} = "
                       f"static_cast<{const}{STORAGE[buf.storage]}*>(bufs[{self.slots[name]}]);")
            rows = f"n * {math.prod(k.row_shape[1:])}" if self.n_axis == "rows" else str(k.rows)
            trips = f"n * {math.prod(k.col_shape[1:]) // k.unroll}" if self.n_axis == "cols" else str(k.trips)
            e.line(f"const int64_t R = {rows}, N = {trips};")
            e.line(f"const int nt = R * N * {k.unroll} >= {PARALLEL_MIN_ELEMENTS} ? nthreads : 1;")
            if k.kind == "cols":
                self._write_cols(rows_too)
            elif not k.has_reductions and (self.n_axis == "cols" or k.trips > CHUNK // k.unroll):
                self._write_chunked()
            else:
                self._write_rows()

    def _used_buffers(self) -> set[str]:
        return _loaded(self.k) | _stored(self.k)

    # -- kernel shapes ----------------------------------------------------------------------------
    def _write_rows(self) -> None:
        e = self.e
        e.line("#pragma omp parallel for num_threads(nt) schedule(static)")
        with e.block("for (int64_t r = 0; r < R; ++r) {", "}"):
            for buf in self.k.row_buffers:
                if buf.name not in self.in_output:
                    e.line(f"alignas(64) {STORAGE[buf.storage]} {buf.name}[{buf.shape[0]}];")
            for block in self.k.blocks:
                self._block(block, "0", "N")

    def _write_chunked(self) -> None:
        e = self.e
        chunk = CHUNK // self.k.unroll
        e.line(f"const int64_t chunks = (N + {chunk - 1}) / {chunk};")  # from N: a length read at the call too
        e.line("#pragma omp parallel for num_threads(nt) schedule(static)")
        with e.block("for (int64_t t = 0; t < R * chunks; ++t) {", "}"):
            e.line("const int64_t r = t / chunks;")
            e.line(f"const int64_t c0 = (t % chunks) * {chunk};")
            e.line(f"const int64_t c1 = acc_min_i64(c0 + {chunk}, N);")
            for block in self.k.blocks:
                self._block(block, "c0", "c1")

    def _write_cols(self, rows_too: _KernelWriter | None = None) -> None:
        """Per-thread partial accumulators, combined in thread order so results are reproducible."""
        e, (loop, *post) = self.e, self.k.blocks
        for red in loop.reductions:
            e.line(f"{CTYPE[red.ctype]}* {red.name}_part = new {CTYPE[red.ctype]}[nt * N];")
            e.line(f"for (int64_t i = 0; i < nt * N; ++i) {red.name}_part[i] = {REDUCE_INIT[red.op, red.ctype]};")
        # fp32 sums over rows go through a partial of SUM_BLOCK rows, added to the thread's sum (see _block),
        # where there may be more rows than that (a second buffer per thread otherwise: a review's)
        long = self.n_axis == "rows" or self.k.rows > SUM_BLOCK
        sums = [r for r in loop.reductions if _blocked(r)] if long else []
        into = {r.name: f"{r.name}_blk" if r in sums else f"{r.name}_mine" for r in loop.reductions}
        e.line("#pragma omp parallel num_threads(nt)")
        with e.block("{", "}"):
            e.line("const int64_t tid = omp_get_thread_num();")
            for red in loop.reductions:
                e.line(f"{CTYPE[red.ctype]}* __restrict__ {red.name}_mine = {red.name}_part + tid * N;")
            for red in sums:
                e.line(f"float* __restrict__ {red.name}_blk = new float[N]();")
            if sums:
                e.line("int64_t rows_in_blk = 0;")
            e.line("#pragma omp for schedule(static)")
            with e.block("for (int64_t r = 0; r < R; ++r) {", "}"):
                e.line("#pragma omp simd")
                with e.block("for (int64_t c = 0; c < N; ++c) {", "}"):
                    self._stmts(loop.stmts)
                    for red in loop.reductions:
                        e.line(_update(red.op, f"{into[red.name]}[c]", red.value))
                if sums:
                    with e.block(f"if (++rows_in_blk == {SUM_BLOCK}) {{", "}"):
                        self._flush_partials(sums)
                        e.line("rows_in_blk = 0;")
                if rows_too is not None:  # the same row again, now in L1: the rows kernel's blocks
                    with e.block("{", "}"):  # its names in a scope of their own
                        for block in rows_too.k.blocks:
                            rows_too._block(block, "0", "N")
            self._flush_partials(sums)
            for red in sums:
                e.line(f"delete[] {red.name}_blk;")
        with e.block("for (int64_t c = 0; c < N; ++c) {", "}"):
            for red in loop.reductions:
                e.line(f"{CTYPE[red.ctype]} {red.name} = {red.name}_part[c];")
                e.line("for (int64_t t = 1; t < nt; ++t) "
                       + _update(red.op, red.name, f"{red.name}_part[t * N + c]"))
            for block in post:
                self._stmts(block.stmts)
                self._stores(block)
        for red in loop.reductions:
            e.line(f"delete[] {red.name}_part;")

    def _flush_partials(self, sums: list[Reduction]) -> None:
        """A cols kernel's partial sums of rows into the thread's sums, and the partials back to 0."""
        if not sums:
            return
        self.e.line("#pragma omp simd")
        with self.e.block("for (int64_t c = 0; c < N; ++c) {", "}"):
            for red in sums:
                self.e.line(f"{red.name}_mine[c] += {red.name}_blk[c]; {red.name}_blk[c] = 0.0f;")

    def _block(self, block: Block, lo: str, hi: str) -> None:
        e = self.e
        if block.level == "outer":
            self._stmts(block.stmts)
            self._stores(block)
            return
        for red in block.reductions:
            e.line(f"{CTYPE[red.ctype]} {red.name} = {REDUCE_INIT[red.op, red.ctype]};")
        long = self.n_axis == "cols" or self.k.trips * self.k.unroll > SUM_BLOCK  # a row's terms (N read at the call, or fixed)
        sums = [r for r in block.reductions if _blocked(r)] if long else []
        if not sums:
            self._simd_loop(block, lo, hi, sums)
            return
        # fp32 sums add SUM_BLOCK elements at a time into a partial, then the partial into the total: a
        # straight running sum's error grows with the row's length (3.7e-4 relative over 16M elements,
        # a fuzzer's; ATen's cascade 1.6e-8)
        with e.block(f"for (int64_t b0 = {lo}; b0 < {hi}; b0 += {SUM_BLOCK}) {{", "}"):
            e.line(f"const int64_t b1 = acc_min_i64(b0 + {SUM_BLOCK}, {hi});")
            for red in sums:
                e.line(f"float {red.name}_blk = 0.0f;")
            self._simd_loop(block, "b0", "b1", sums)
            for red in sums:
                e.line(f"{red.name} += {red.name}_blk;")

    def _simd_loop(self, block: Block, lo: str, hi: str, blocked: list[Reduction]) -> None:
        """The vectorized loop over columns ``[lo, hi)``; the ``blocked`` sums go to their partials."""
        e = self.e
        into = {r.name: f"{r.name}_blk" if r in blocked else r.name for r in block.reductions}
        clauses = "".join(f" reduction({(OMP_REDUCE_F32 if r.ctype == 'f32' else OMP_REDUCE)[r.op]}:{into[r.name]})"
                          for r in block.reductions)
        e.line(f"#pragma omp simd{clauses}")
        with e.block(f"for (int64_t c = {lo}; c < {hi}; ++c) {{", "}"):
            self._stmts(block.stmts)
            for red in block.reductions:
                e.line(_update(red.op, into[red.name], red.value))
            self._stores(block)

    # -- statements -------------------------------------------------------------------------------
    def _stmts(self, stmts: list[Stmt]) -> None:
        for s in stmts:
            self.e.line(f"const {CTYPE[s.ctype]} {s.name} = {self._expr(s)};")

    def _expr(self, s: Stmt) -> str:
        if s.op == "load":
            buf = self.buffers[s.args[0]]
            ref = self._ref(buf.name, s.args[1])
            return f"bf16_to_f32({ref})" if buf.storage == "bf16" else ref
        if s.op == "const":
            return _literal(s.args[0], s.ctype)
        if s.op == "index":
            return print_index(s.args[0], "cpp")
        if s.op == "cast":
            if self.ctype_of.get(s.args[0]) == "bool" and s.ctype == "f32":
                # A select, not a conversion: g++ leaves a loop scalar that converts a mask from a
                # 64-bit compare (a one-hot from class ids) to float, and vectorizes the select.
                return f"({s.args[0]} ? 1.0f : 0.0f)"
            return f"static_cast<{CTYPE[s.ctype]}>({s.args[0]})"
        if s.ctype != "f32" and s.op in INT_OPS:
            return INT_OPS[s.op].format(*s.args)
        if s.op == "where" and s.ctype == "f32" and s.args[0] in self.row_invariant:
            # A condition fixed for the row (a fully masked attention row): g++ turns `c ? x : y` of two
            # loads into a masked load it cannot vectorize beside other work (dropout's numbers); a
            # select of bits reads both and vectorizes.
            return f"acc_pick({s.args[0]}, {s.args[1]}, {s.args[2]})"
        return CPP.op(s.op, *s.args)

    def _stores(self, block: Block) -> None:
        for st in block.stores:
            buf = self.buffers[st.buffer]
            if buf.role == "row":
                value = st.value
            elif buf.storage == "bf16":
                value = f"f32_to_bf16({st.value})"
            else:
                value = f"static_cast<{STORAGE[buf.storage]}>({st.value})"
            self.e.line(f"{self._ref(buf.name, st.index)} = {value};")

    def _ref(self, name: str, index: Any) -> str:
        if name in self.in_output:  # a row scratch kept in the output row it is finally replaced by
            name, index = self.in_output[name]
        return f"{name}[{print_index(index, 'cpp')}]"


def rows_kept_in_outputs(kernel: Kernel, buffers: dict[str, Buffer]) -> dict[str, tuple[str, Any]]:
    """Row scratch that can live in an output instead: {row buffer: (output, index at column c)}.

    Softmax-like kernels store a value per column in one pass (exp) and read it back in a later pass
    that writes an fp32 output at the same column. Keeping the value in that output row (written in
    place by the last pass) is ~10 % faster than a stack scratch here: one stream of stores fewer.
    It is safe when the output row is contiguous in c, the output is written by one block only, and
    no block after that one reads the scratch (each thread owns its rows)."""
    if kernel.kind != "rows" or kernel.unroll != 1:
        return {}
    inner = [b for b in kernel.blocks if b.level == "inner"]
    readers = {r.name: [i for i, b in enumerate(inner) if any(s.op == "load" and s.args[0] == r.name for s in b.stmts)]
               for r in kernel.row_buffers}  # fmt: skip
    taken: set[str] = set()
    out: dict[str, tuple[str, Any]] = {}
    for row in kernel.row_buffers:
        if row.dtype != torch.float32 or not readers[row.name]:
            continue
        last = max(readers[row.name])
        for st in inner[last].stores:
            buf = buffers[st.buffer]
            writers = [b for b in kernel.blocks if any(x.buffer == st.buffer for x in b.stores)]
            offset = st.index - C
            if (buf.role == "output" and buf.storage == "f32" and st.buffer not in taken and len(writers) == 1
                    and C not in getattr(offset, "free_symbols", ())):  # fmt: skip
                out[row.name] = (st.buffer, st.index)
                taken.add(st.buffer)
                break
    return out


class CppRegion:
    """The compiled region: allocates outputs, passes data pointers, returns the outputs.

    A region runs dozens of times a step, often right after a matmul has pushed the interpreter's
    state out of the caches, so its Python around the kernel is kept short: once a call's inputs
    were all laid out as the kernel expects, later calls check them with one C++ guard (dtype,
    device, sizes, strides, as Dynamo checks a frame's tensors) and only a call the guard rejects
    takes the per-input path that copies what does not conform."""

    fresh_outputs = True  # every output is a new tensor (read by fast_calls)

    def __init__(self, program: LoopProgram, lib: ctypes.CDLL, entry: str = ENTRY, length: int = 0) -> None:
        self.program = program
        self.library, self.entry = lib._name, entry
        self._length = length  # the kernels' n: a CppLengthRegion's length, which it made this one for
        self.fn = getattr(lib, entry)
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        self.fn.restype = None
        self.inputs = program.of_role("input")
        self.outputs = program.of_role("output")
        self.temps = program.of_role("temp")
        self._ptrs = ctypes.c_void_p * len(program.buffers)
        # What an input must be for the kernel to read it as is (the usual case, checked per call
        # without building anything): its device, dtype, sizes and the strides of axes longer than 1.
        self._expected = [(b.dtype, torch.Size(b.shape), _long_axes(b)) for b in self.inputs]
        self._allocs = [(b.shape, b.stride, b.dtype) for b in self.outputs] + [
            (b.shape, contiguous_strides(b.shape), b.dtype) for b in self.temps]
        self._n_out = len(self.outputs)
        self._guard: Any = None  # made from the first call whose inputs all conform
        # Arguments that are sizes (views' and expands', which the kernels read from the shapes): not passed on.
        self._sizes = frozenset(program.size_inputs)

    def _tensors(self, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        """The call's tensor arguments: its sizes left out."""
        if len(args) != len(self.inputs) + len(self._sizes):
            raise TypeError(f"compiled region takes {len(self.inputs) + len(self._sizes)} inputs, got {len(args)}")
        return tuple(a for i, a in enumerate(args) if i not in self._sizes)

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        if self._sizes:
            args = self._tensors(args)
        if self._guard is None or not self._guard.check(*args):
            return self._checked_call(args)
        made = [_empty_strided(shape, stride, dtype) for shape, stride, dtype in self._allocs]
        self.fn(self._ptrs(*[t.data_ptr() for t in args], *[t.data_ptr() for t in made]), self._length, torch.get_num_threads())
        return tuple(made[: self._n_out])

    def _checked_call(self, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if len(args) != len(self.inputs):
            raise TypeError(f"compiled region takes {len(self.inputs)} inputs, got {len(args)}")
        conform = [_as_expected(t, e) for t, e in zip(args, self._expected, strict=True)]
        ins = [t if ok else _conform(t, b) for t, ok, b in zip(args, conform, self.inputs, strict=True)]
        if all(conform) and self._guard is None:
            self._guard = _input_guard(args)
        # Outputs take the strides the kernel writes (those eager gave the node: loop_ir.output_strides).
        made = [_empty_strided(shape, stride, dtype) for shape, stride, dtype in self._allocs]
        self.fn(self._ptrs(*[t.data_ptr() for t in ins], *[t.data_ptr() for t in made]), self._length, torch.get_num_threads())
        return tuple(made[: self._n_out])

    def __reduce__(self) -> tuple:
        return saved_region(self.library, self.entry, self.program)


class CppRowsRegion(CppRegion):
    """A region whose leading size changes between calls (``codegen.runtime_rows``): each call reads
    the row count from one input, checks the others against it, allocates its outputs with as many
    rows and passes the count to the kernels. Per-input checks in Python: such graphs are a mixture's
    experts, not the hot path the static region's C++ guard serves."""

    def __init__(self, program: LoopProgram, lib: ctypes.CDLL, entry: str = ENTRY) -> None:
        super().__init__(program, lib, entry)
        rows = program.runtime_rows
        self._source = next(i for i, b in enumerate(self.inputs) if b.name == rows.input)
        self._dynamic_in = [b.name in rows.buffers for b in self.inputs]
        self._dynamic_alloc = [b.name in rows.buffers for b in (*self.outputs, *self.temps)]
        # Tensors whose rows are several leading axes ([16, s, 256] as 16*s rows): those axes, -1 the changing one.
        leads = dict(rows.leading_axes)
        self._in_leads = [leads.get(b.name) for b in self.inputs]
        self._out_leads = [leads.get(b.name) for b in self.outputs]

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        args = self._tensors(args)
        source, lead = args[self._source], self._in_leads[self._source]
        n = source.shape[0] if lead is None else math.prod(source.shape[: len(lead)])
        ins = []
        for t, buf, dynamic, lead in zip(args, self.inputs, self._dynamic_in, self._in_leads, strict=True):
            if lead is not None:
                if not leads_with(t, lead, buf.shape[1:]):
                    raise ValueError(f"compiled region: an input of sizes {list(t.shape)} where "
                                     f"{[*lead, *buf.shape[1:]]} (-1: any) was expected")  # fmt: skip
                t = t.reshape(n, *buf.shape[1:])  # a view where the leading axes are laid out as rows
            if dynamic and not _rows_as_expected(t, buf, n):
                t = _conform(t, dataclasses.replace(buf, shape=(n, *buf.shape[1:])))
            elif not dynamic and not _as_expected(t, (buf.dtype, torch.Size(buf.shape), _long_axes(buf))):
                t = _conform(t, buf)
            ins.append(t)
        made = [_empty_strided((n, *shape[1:]) if dynamic else shape, stride, dtype)
                for (shape, stride, dtype), dynamic in zip(self._allocs, self._dynamic_alloc, strict=True)]  # fmt: skip
        self.fn(self._ptrs(*[t.data_ptr() for t in ins], *[t.data_ptr() for t in made]), n, torch.get_num_threads())
        return tuple(t if lead is None else t.view(*lead, *t.shape[1:])
                     for t, lead in zip(made[: self._n_out], self._out_leads, strict=True))  # fmt: skip


class CppLengthRegion(CppRegion):
    """A region whose sizes follow one changing length (``codegen.linear_sizes``): each call reads the
    length from one input and runs the fixed-size region for that length (the same kernels, given the
    length as ``n``), made at the length's first call and kept: a run meets a few lengths many times
    each, and each keeps its own C++ guard."""

    MAX_LENGTHS_KEPT = 4096

    def __init__(self, program: LoopProgram, lib: ctypes.CDLL, entry: str = ENTRY) -> None:
        super().__init__(program, lib, entry)
        self._lib = lib
        self._layouts = program.linear_sizes.layouts  # in the order of program.buffers
        name, axis = program.linear_sizes.read_from
        i = next(i for i, b in enumerate(self.inputs) if b.name == name)
        self._read_from = (i, axis, next(lay for lay in self._layouts if lay.name == name).shape[axis])
        self._at_length: dict[int, CppRegion] = {}

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        args = self._tensors(args)
        s = self._length_of(args)
        return (self._at_length.get(s) or self._region_at(s))(*args)

    def _length_of(self, args: tuple[torch.Tensor, ...]) -> int:
        i, axis, size = self._read_from
        s, rest = divmod(args[i].shape[axis] - size.b, size.a)
        if rest or s < 1:
            raise ValueError(f"compiled region: input {self.inputs[i].name}'s size {args[i].shape[axis]} on axis "
                             f"{axis} is not {size.a}·s + {size.b} for a length s")  # fmt: skip
        return s

    def _region_at(self, s: int) -> CppRegion:
        buffers = [dataclasses.replace(b, shape=shape, stride=stride)
                   for b, (shape, stride) in zip(self.program.buffers, (lay.at(s) for lay in self._layouts),
                                                 strict=True)]  # fmt: skip
        region = CppRegion(LoopProgram(buffers, []), self._lib, self.entry, length=s)
        if len(self._at_length) < self.MAX_LENGTHS_KEPT:
            self._at_length[s] = region
        return region

    def differs_at_short_lengths(self, region: Any) -> str | None:
        """Checked once, when built (lower._checked_at_build): see codegen.short_lengths. The lengths
        the check met are forgotten after it, so that no guard is made from its made-up inputs."""
        from accelrun.compile.codegen.short_lengths import differs_at_short_lengths

        met = set(self._at_length)
        try:
            return differs_at_short_lengths(region, self, self.program.linear_sizes.symbol)
        finally:
            for s in set(self._at_length) - met:
                del self._at_length[s]


def cpp_region(program: LoopProgram, lib: ctypes.CDLL, entry: str = ENTRY) -> CppRegion:
    """The callable for a compiled program: fixed sizes, rows read at each call, or a length read at
    each call."""
    if program.linear_sizes is not None:
        return CppLengthRegion(program, lib, entry)
    return (CppRegion if program.runtime_rows is None else CppRowsRegion)(program, lib, entry)


def saved_region(library: str, entry: str, program: LoopProgram) -> tuple:
    """How a compiled region pickles (the graph cache): the library is found again by its path; running
    it needs the buffers' layout (and which have runtime rows) only, not the kernels' IR."""
    return (_restore_region, (library, entry, program.buffers, program.runtime_rows, program.size_inputs,
                              program.linear_sizes))  # fmt: skip


def _input_guard(args: tuple[torch.Tensor, ...]) -> Any:
    """A C++ check that tensors match ``args`` in dtype, device, sizes, strides (and autograd and
    dispatch state), or None where this PyTorch has none or the arguments are not plain tensors."""
    if TensorGuards is None:
        return None
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in args):
        return None  # a tensor subclass: its layout is its own business, keep the per-input path
    try:
        return TensorGuards(*args, dynamic_dims_sizes=[list(t.shape) for t in args],
                            dynamic_dims_strides=[list(t.stride()) for t in args])  # fmt: skip
    except Exception:  # a private API: without it every call takes the per-input path
        return None


def _empty_strided_py(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype)


# Dynamo's CPU allocator (what Inductor's generated code calls) skips the Python argument parser:
# half the cost of torch.empty_strided, which a region pays for each output.
_empty_strided = empty_strided_cpu or _empty_strided_py


def _restore_region(library: str, entry: str, buffers: list[Buffer], runtime_rows: Any = None,
                    size_inputs: tuple[int, ...] = (), linear_sizes: Any = None) -> CppRegion:  # fmt: skip
    path = found(library, "compiled region")
    program = LoopProgram(buffers, [], runtime_rows, size_inputs, linear_sizes)
    return cpp_region(program, load_library(path), entry)


def _long_axes(buf: Buffer) -> list[tuple[int, int]]:
    """(axis, stride) of the axes longer than 1: a size-1 axis's stride is never used."""
    return [(d, st) for d, (n, st) in enumerate(zip(buf.shape, buf.stride, strict=True)) if n != 1]


def _as_expected(t: torch.Tensor, expected: tuple) -> bool:
    dtype, shape, strides = expected
    if t.dtype != dtype or t.shape != shape or t.device.type != "cpu":
        return False
    stride = t.stride()
    return all(stride[d] == st for d, st in strides)


def _rows_as_expected(t: torch.Tensor, buf: Buffer, n: int) -> bool:
    """``_as_expected`` for a buffer whose leading size is the call's ``n``: its other sizes, and the
    strides of its axes longer than 1, as the kernel reads them."""
    if t.dtype != buf.dtype or t.device.type != "cpu" or t.dim() != len(buf.shape) or t.shape[0] != n:
        return False
    if tuple(t.shape[1:]) != buf.shape[1:]:
        return False
    stride = t.stride()
    return all(stride[d] == st for d, (size, st) in enumerate(zip(t.shape, buf.stride, strict=True)) if size != 1)


def _conform(t: torch.Tensor, buf: Buffer) -> torch.Tensor:
    """The tensor laid out as the kernel was specialised for (a copy only if it is not already)."""
    if t.dtype != buf.dtype and buf.dtype == torch.float32 and t.dtype in (torch.bfloat16, torch.float16):
        # The graph's fake tensor said fp32 where the CPU kernel made bf16 (PyTorch's meta function for
        # batch norm's running statistics does so): widening is exact, so the kernel still applies.
        t = t.float()
    if t.device.type != "cpu" or t.dtype != buf.dtype or tuple(t.shape) != buf.shape:
        raise ValueError(f"input {buf.name}: expected a cpu {buf.dtype} {list(buf.shape)} tensor, "
                         f"got {t.device.type} {t.dtype} {list(t.shape)}")
    if all(s == bs or n == 1 for s, bs, n in zip(t.stride(), buf.stride, buf.shape, strict=True)):
        return t
    return torch.empty_strided(buf.shape, buf.stride, dtype=buf.dtype).copy_(t)

"""Triton for a ``LoopProgram``: one ``@triton.jit`` kernel per loop-IR kernel, plus a ``launch``.

Each program instance takes a ``BLOCK_R x BLOCK_N`` tile: ``r`` is a column vector of rows, ``c`` a
row vector of columns, so per-row (``outer``) values are ``[BLOCK_R, 1]`` and per-element (``inner``)
values ``[BLOCK_R, BLOCK_N]``. A kernel with row reductions holds a whole row in one tile
(``tl.sum(..., axis=1)``); a column reduction loops over row tiles. Shapes are baked in as literals.

The module is written into the cache directory (named by a hash of its text) and imported from
there, since ``triton.jit`` reads kernel source from files. On a CPU it runs under
``TRITON_INTERPRET=1``, which triton reads when the module is imported (decorated).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

from accelrun.compile.codegen.emitter import Emitter
from accelrun.compile.codegen.index_print import print_index
from accelrun.compile.codegen.loop_ir import Block, Buffer, Kernel, LoopProgram, Stmt, Unsupported

TILE_ELEMENTS = 4096  # elements a program instance works on, when the shapes allow
MAX_ROW = 16384  # a row reduced in one tile cannot be longer than this

TL_TYPE = {"f32": "tl.float32", "i64": "tl.int64", "i32": "tl.int32", "bool": "tl.int1"}
STORAGE = {"f32": "tl.float32", "bf16": "tl.bfloat16", "f16": "tl.float16", "i64": "tl.int64",
           "i32": "tl.int32", "i16": "tl.int16", "i8": "tl.int8", "u8": "tl.uint8", "bool": "tl.int1"}

OPS = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
    "maximum": "tl.where(({0} != {0}) | ({0} > {1}), {0}, {1})",
    "minimum": "tl.where(({0} != {0}) | ({0} < {1}), {0}, {1})",
    "pow": "libdevice.pow({0}, {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})", "and": "({0} & {1})", "or": "({0} | {1})", "not": "({0} == 0)",
    "neg": "(-{0})", "abs": "tl.abs({0})", "exp": "tl.exp({0})", "log": "tl.log({0})",
    "log1p": "libdevice.log1p({0})", "expm1": "libdevice.expm1({0})", "tanh": "libdevice.tanh({0})",
    "sigmoid": "(1.0 / (1.0 + tl.exp(-{0})))", "rsqrt": "tl.rsqrt({0})", "sqrt": "tl.sqrt({0})", "erf": "tl.erf({0})",
    "reciprocal": "(1.0 / {0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})", "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})", "trunc": "libdevice.trunc({0})",
    "sign": "(({0} > 0).to(tl.int32) - ({0} < 0).to(tl.int32))",
    "round_bf16": "{0}.to(tl.bfloat16).to(tl.float32)", "round_f16": "{0}.to(tl.float16).to(tl.float32)",
    "where": "tl.where({0}, {1}, {2})",
}  # fmt: skip

IDENTITY = {("sum", "f32"): "0.0", ("max", "f32"): "float('-inf')", ("min", "f32"): "float('inf')",
            ("sum", "i64"): "0", ("max", "i64"): "-(2**63)", ("min", "i64"): "2**63 - 1",
            ("sum", "i32"): "0", ("max", "i32"): "-(2**31)", ("min", "i32"): "2**31 - 1"}
# Reductions go through tl.reduce with combine functions of the generated module itself, not tl.sum /
# tl.max: those are triton.jit functions decorated when triton was imported, which under
# TRITON_INTERPRET=1 only works if the variable was set before that import.
TL_REDUCE = {"sum": "tl.reduce({0}, {1}, _acc_add)", "max": "tl.reduce({0}, {1}, _acc_max)",
             "min": "tl.reduce({0}, {1}, _acc_min)"}
COMBINE = {"sum": "{a} + {b}", "max": "tl.maximum({a}, {b})", "min": "tl.minimum({a}, {b})"}

HEADER = """\
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _acc_add(a, b):
    return a + b


@triton.jit
def _acc_max(a, b):
    return tl.where((a != a) | (a > b), a, b)


@triton.jit
def _acc_min(a, b):
    return tl.where((a != a) | (a < b), a, b)
"""


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tiles(kernel: Kernel) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_N) of a kernel: whole rows when it reduces them."""
    if kernel.kind == "rows" and kernel.has_reductions:
        if kernel.cols > MAX_ROW:
            raise Unsupported(f"a row of {kernel.cols} elements is too long for one Triton tile")
        block_n = _pow2(kernel.cols)
    else:
        block_n = min(_pow2(kernel.cols), 1024)
    block_r = max(1, min(_pow2(kernel.rows), TILE_ELEMENTS // block_n))
    return block_r, block_n


def grid(kernel: Kernel) -> tuple[int, int]:
    block_r, block_n = tiles(kernel)
    if kernel.kind == "cols":
        return (-(-kernel.cols // block_n), 1)
    return (-(-kernel.rows // block_r), -(-kernel.cols // block_n))


def triton_source(program: LoopProgram) -> str:
    for buf in program.buffers:
        if _numel(buf) >= 2**31:
            raise Unsupported("tensors of 2**31 elements or more (Triton indices are 32-bit here)")
    e = Emitter()
    e.lines(HEADER)
    for kernel in program.kernels:
        e.line()
        e.line()
        _KernelWriter(e, kernel, program.buffers).write()
    names = [b.name for b in program.buffers]
    e.line()
    e.line()
    with e.block(f"def launch({', '.join(names)}):"):
        for kernel in program.kernels:
            block_r, block_n = tiles(kernel)
            args = ", ".join(_kernel_buffers(kernel, program.buffers))
            e.line(f"{kernel.name}[{grid(kernel)}]({args}, BLOCK_R={block_r}, BLOCK_N={block_n})")
        if not program.kernels:
            e.line("pass")
    return e.source()


def _numel(buf: Buffer) -> int:
    n = 1
    for s in buf.shape:
        n *= s
    return n


def _kernel_buffers(kernel: Kernel, buffers: list[Buffer]) -> list[str]:
    used = set()
    for b in kernel.blocks:
        used |= {s.args[0] for s in b.stmts if s.op == "load"} | {s.buffer for s in b.stores}
    return [b.name for b in buffers if b.name in used]


class _KernelWriter:
    def __init__(self, e: Emitter, kernel: Kernel, buffers: list[Buffer]) -> None:
        self.e, self.k = e, kernel
        self.buffers = {b.name: b for b in buffers}
        self.args = _kernel_buffers(kernel, buffers)

    def write(self) -> None:
        e, k = self.e, self.k
        e.line("@triton.jit")
        with e.block(f"def {k.name}({', '.join(self.args)}, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):"):
            if k.kind == "cols":
                self._write_cols()
                return
            e.line("r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]")
            e.line("c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
            e.line(f"rmask = r < {k.rows}")
            e.line(f"mask = rmask & (c < {k.cols})")
            e.line("zero_outer = r * 0")
            e.line("zero_inner = r * 0 + c * 0")
            for block in k.blocks:
                level = "inner" if block.level == "inner" else "outer"
                mask = "mask" if level == "inner" else "rmask"
                self._stmts(block.stmts, mask, f"zero_{level}")
                for red in block.reductions:
                    init = IDENTITY[red.op, red.ctype]
                    full = f"tl.where(mask, {red.value} + zero_inner.to({TL_TYPE[red.ctype]}), {init})"
                    e.line(f"{red.name} = {TL_REDUCE[red.op].format(full, 1)}[:, None]")
                self._stores(block, mask, f"zero_{level}")

    def _write_cols(self) -> None:
        e, k = self.e, self.k
        loop, *post = k.blocks
        e.line("c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
        e.line(f"cmask = c < {k.cols}")
        e.line("zero_col = c * 0")
        for red in loop.reductions:
            e.line(f"{red.name}_part = tl.full([BLOCK_R, BLOCK_N], {IDENTITY[red.op, red.ctype]}, "
                   f"{TL_TYPE[red.ctype]})")
        with e.block(f"for r0 in range(0, {k.rows}, BLOCK_R):"):
            e.line("r = r0 + tl.arange(0, BLOCK_R)[:, None]")
            e.line(f"mask = (r < {k.rows}) & cmask")
            e.line("zero_inner = r * 0 + c * 0")
            self._stmts(loop.stmts, "mask", "zero_inner")
            for red in loop.reductions:
                init = IDENTITY[red.op, red.ctype]
                value = f"tl.where(mask, {red.value} + zero_inner.to({TL_TYPE[red.ctype]}), {init})"
                e.line(f"{red.name}_part = " + COMBINE[red.op].format(a=f"{red.name}_part", b=value))
        for red in loop.reductions:
            e.line(f"{red.name} = {TL_REDUCE[red.op].format(red.name + '_part', 0)}[None, :]")
        for block in post:
            self._stmts(block.stmts, "cmask", "zero_col")
            self._stores(block, "cmask", "zero_col")

    def _stmts(self, stmts: list[Stmt], mask: str, zero: str) -> None:
        for s in stmts:
            self.e.line(f"{s.name} = {self._expr(s, mask, zero)}")

    def _expr(self, s: Stmt, mask: str, zero: str) -> str:
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
        if s.op not in OPS:
            raise Unsupported(f"op {s.op} has no Triton form")
        expr = OPS[s.op].format(*s.args)
        return f"({expr}).to({TL_TYPE[s.ctype]})" if s.op == "sign" else expr

    def _stores(self, block: Block, mask: str, zero: str) -> None:
        for st in block.stores:
            buf = self.buffers[st.buffer]
            ptr = f"{buf.name} + {print_index(st.index, 'triton')} + {zero}"
            self.e.line(f"tl.store({ptr}, {st.value}.to({STORAGE[buf.storage]}), mask={mask})")


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


def load_module(source: str, cache_dir: str | os.PathLike | None = None) -> Any:
    """Import the generated module from ``<cache_dir>/<sha256>.py`` (written atomically)."""
    key = hashlib.sha256(source.encode()).hexdigest()
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"accelrun_{key[:32]}.py"
    if not path.exists():
        tmp = directory / f".{path.name}.{os.getpid()}.tmp"
        tmp.write_text(source)
        os.replace(tmp, path)
    name = f"accelrun_triton_{key[:32]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class TritonRegion:
    """Allocates outputs on the inputs' device and launches the kernels in order."""

    def __init__(self, program: LoopProgram, module: Any) -> None:
        self.launch = module.launch
        self.inputs = program.of_role("input")
        self.outputs = program.of_role("output")
        self.temps = program.of_role("temp")

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(args) != len(self.inputs):
            raise TypeError(f"compiled region takes {len(self.inputs)} inputs, got {len(args)}")
        device = args[0].device if args else torch.device("cpu")
        ins = [_conform(t, b) for t, b in zip(args, self.inputs, strict=True)]
        outs = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in self.outputs]
        temps = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in self.temps]
        self.launch(*ins, *outs, *temps)
        return tuple(outs)


def _conform(t: torch.Tensor, buf: Buffer) -> torch.Tensor:
    if t.dtype != buf.dtype or tuple(t.shape) != buf.shape:
        raise ValueError(f"input {buf.name}: expected {buf.dtype} {list(buf.shape)}, got {t.dtype} {list(t.shape)}")
    if all(s == bs or n == 1 for s, bs, n in zip(t.stride(), buf.stride, buf.shape, strict=True)):
        return t
    return torch.empty_strided(buf.shape, buf.stride, dtype=buf.dtype, device=t.device).copy_(t)

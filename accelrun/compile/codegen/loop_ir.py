"""Loop-level IR of a fusion region: kernels, each a loop over rows with straight-line code per row.

A region becomes a ``LoopProgram``: buffers (inputs, outputs, temporaries) and kernels run in order.
Every kernel iterates a 2-d domain, ``rows x cols`` (each side a tuple of tensor axes, flattened to
the loop variables ``r`` and ``c``), and is one of

- ``rows``: for each row, a sequence of blocks: ``outer`` blocks (code that depends on the row only)
  alternate with ``inner`` blocks (a loop over ``c``). An inner block may fold values into per-row
  reductions, which later blocks read as scalars. Reductions that do not depend on each other share
  one inner loop (one pass over the row); softmax needs two (max, then the sum of exponentials).
  Region outputs of the full domain are stored by a last inner block (the epilogue).
- ``cols``: reductions over the leading axes, keeping the trailing ones (the weight gradient of a
  norm): one inner block over all ``(r, c)`` accumulating per column, then an ``outer`` block per
  column that finishes and stores.

Statements are SSA (``Stmt``): a name, an op of ``codegen.ops.OPS`` (plus ``load``, ``const``,
``index``, ``cast``), operand names, and a compute type (``f32``, ``i64``, ``i32``, ``bool``). Index
expressions are sympy over ``r`` and ``c``. C++ and Triton print the same program with their own
tables (``codegen/cpp.py``, ``codegen/triton.py``).

    program = lower_region(region)   # raises Unsupported("op aten.mm is not pointwise …")
    print(program.describe())
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import sympy
import torch

from accelrun.compile.codegen.index_simplify import MODS, simplify_index
from accelrun.compile.codegen.ops import OPS
from accelrun.compile.codegen.values import (
    Const,
    GraphValues,
    Index,
    Input,
    Op,
    Reduce,
    Select,
    Unsupported,
    Value,
    View,
    broadcast_index,
    compute_type,
    fixed,
    ravel,
    reshape_map,
    unravel,
)
from accelrun.torch_private import FloorDiv

__all__ = ["Unsupported", "LoopProgram", "Kernel", "Block", "Stmt", "Store", "Reduction", "Buffer",
           "lower_region", "lower_graph", "R", "C"]

# The two loop variables every kernel is written in.
R = sympy.Symbol("r", integer=True, nonnegative=True)
C = sympy.Symbol("c", integer=True, nonnegative=True)

_STORAGE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int64: "i64",
            torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "bool"}


@dataclass
class Buffer:
    name: str  # in0, out0, tmp0
    role: str  # input | output | temp
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def storage(self) -> str:
        return _STORAGE[self.dtype]


@dataclass
class Stmt:
    name: str
    op: str  # load | const | index | cast | an op of codegen.ops.OPS
    args: tuple[Any, ...]  # operand names; (buffer, index) for load; (value,) for const; (expr,) for index
    ctype: str


@dataclass
class Store:
    buffer: str
    index: sympy.Expr
    value: str


@dataclass
class Reduction:
    name: str  # the accumulator; after its block it holds the result
    op: str  # sum | max | min
    value: str
    ctype: str


@dataclass
class Block:
    level: str  # outer | inner
    stmts: list[Stmt] = field(default_factory=list)
    reductions: list[Reduction] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.stmts or self.reductions or self.stores)


@dataclass
class Kernel:
    name: str
    kind: str  # rows | cols
    row_shape: tuple[int, ...]
    col_shape: tuple[int, ...]
    blocks: list[Block] = field(default_factory=list)
    # Columns per step of the inner loop: with 2, the loop variable ``c`` counts pairs and each inner
    # block holds both elements' code (interleaved pairs, e.g. RoPE, index without gathers).
    unroll: int = 1
    # Per-row scratch (shape ``(cols,)``, role ``row``): a value costly to compute that an earlier
    # inner block stores at ``c`` and a later one loads instead of recomputing it (softmax's exp).
    row_buffers: list[Buffer] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return math.prod(self.row_shape)

    @property
    def cols(self) -> int:
        return math.prod(self.col_shape)

    @property
    def trips(self) -> int:
        """Iterations of the inner loop (``cols / unroll``)."""
        return self.cols // self.unroll

    @property
    def has_reductions(self) -> bool:
        return any(b.reductions for b in self.blocks)


@dataclass
class LoopProgram:
    buffers: list[Buffer]
    kernels: list[Kernel]
    # Set where the leading size of some buffers and kernels is read at each call (a size that changes
    # between calls; ``codegen.runtime_rows.RuntimeRows``): their shapes here hold a made-up count.
    runtime_rows: Any = None
    # Positions of the region's inputs that are sizes, not tensors (a view's, an expand's): skipped.
    size_inputs: tuple[int, ...] = ()
    # Set where sizes follow one changing length read at each call (``codegen.linear_sizes``): the
    # buffers here hold the first made-up length's sizes.
    linear_sizes: Any = None

    def of_role(self, role: str) -> list[Buffer]:
        return [b for b in self.buffers if b.role == role]

    def describe(self) -> str:
        lines = [f"buffer {b.name}: {b.role} {b.storage}{self._shown(b.name, b.shape)} stride {list(b.stride)}"
                 for b in self.buffers]
        if (rows := self.runtime_rows) is not None:
            axes = len(dict(rows.leading_axes).get(rows.input, (0,)))
            read = " * ".join(f"{rows.input}.size({d})" for d in range(axes))
            lines.insert(0, f"n = {read} at each call ({rows.symbol})")
        for k in self.kernels:
            unroll = f", {k.unroll} columns per step" if k.unroll > 1 else ""
            flat = self.runtime_rows is not None and k.name in self.runtime_rows.flat_kernels
            cols = "[" + ", ".join(["n", *map(str, k.col_shape[1:])]) + "]" if flat else str(list(k.col_shape))
            lines.append(f"kernel {k.name} ({k.kind}): rows {self._shown(k.name, k.row_shape)} x cols {cols}{unroll}")
            lines += [f"  scratch {b.name}: {b.storage}[{b.shape[0]}] per row" for b in k.row_buffers]
            for b in k.blocks:
                pad = "    " if b.level == "inner" else "  "
                lines.append(f"{pad[:-2]}{'for c:' if b.level == 'inner' else 'per row:'}")
                lines += [f"{pad}{s.name}: {s.ctype} = {s.op}{s.args}" for s in b.stmts]
                lines += [f"{pad}{x.name} {x.op}= {x.value}" for x in b.reductions]
                lines += [f"{pad}{s.buffer}[{s.index}] = {s.value}" for s in b.stores]
        return "\n".join(lines)

    def _shown(self, name: str, shape: tuple[int, ...]) -> str:
        rows = self.runtime_rows
        if rows is None or (name not in rows.buffers and name not in rows.kernels):
            return str(list(shape))
        return "[" + ", ".join(["n", *map(str, shape[1:])]) + "]"


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Do these strides lay the elements out without gaps or overlaps (a permutation of a contiguous
    layout)? Axes of size 1 may have any stride."""
    step = 1
    for size, st in sorted(((n, st) for n, st in zip(shape, stride, strict=True) if n != 1), key=lambda a: a[1]):
        if st != step:
            return False
        step *= size
    return True


def writes_as_laid_out(meta: torch.Tensor) -> bool:
    """Whether a kernel can write a tensor laid out as ``meta``: dense, or at most one element (the rule
    of ``output_strides``; the region partitioner keeps non-dense views from becoming outputs by it)."""
    return meta.numel() <= 1 or is_dense(tuple(meta.shape), tuple(meta.stride()))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= max(s, 1)
    return tuple(reversed(out))


def lower_region(region: Any) -> LoopProgram:
    """The loop program of a ``Region`` (raises ``Unsupported`` with a short reason)."""
    return lower_graph(region.gm, region.input_meta, region.output_meta)


def lower_graph(gm: torch.fx.GraphModule, input_meta: Sequence[Any], output_meta: Sequence[Any],
                size_inputs: bool = False) -> LoopProgram:
    """``size_inputs``: see ``GraphValues``; the program's ``size_inputs`` lists where they were."""
    for meta in (*input_meta, *output_meta):
        if isinstance(meta, torch.Tensor) and meta.numel() == 0:
            # Nothing to compute, and index arithmetic over an axis of size 0 divides by zero.
            raise Unsupported(f"a zero-size tensor {list(meta.shape)} (left to ATen)")
    values = GraphValues(gm, input_meta, size_inputs)
    strides = []
    for out, meta in zip(values.outputs, output_meta, strict=False):
        if isinstance(meta, torch.Tensor) and (tuple(meta.shape) != out.shape or meta.dtype != out.dtype):
            raise Unsupported(f"output meta {tuple(meta.shape)} {meta.dtype} disagrees with the graph")
        strides.append(output_strides(meta, out.shape))
    program = _Scheduler(values, strides).program()
    program.size_inputs = tuple(values.size_inputs)
    return program


def output_strides(meta: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides a region output is written with: those of the node's ``meta["val"]``, i.e. what
    eager produced. The graph after the region was traced against them: a ``permute`` then ``view``
    of an output that eager laid out (B, T, H, D) but a kernel wrote contiguous (B, H, T, D) fails,
    and an ``as_strided`` would read the wrong elements. A dense layout (any permutation of a
    contiguous one) is written as it is; an output that is not dense (an expand's zero strides, a
    slice) cannot be written by one kernel, so the region is declined."""
    if not isinstance(meta, torch.Tensor):
        return contiguous_strides(shape)
    stride = tuple(fixed(s) for s in meta.stride())
    if meta.numel() <= 1 or stride == contiguous_strides(shape):
        return contiguous_strides(shape)
    if not writes_as_laid_out(meta):
        raise Unsupported(f"output {list(shape)} with strides {list(stride)} is not dense (a view "
                          "of a larger tensor, or an expand); kernels write dense outputs")
    return stride


# -- scheduling: which kernel computes each reduction and each output ------------------------------
@dataclass
class _Plan:
    kind: str
    row_shape: tuple[int, ...]
    col_shape: tuple[int, ...]
    reductions: list[Reduce] = field(default_factory=list)
    full_outputs: list[_Piece] = field(default_factory=list)  # over rows x cols, stored per element
    row_outputs: list[int] = field(default_factory=list)  # outputs per row (shape of the row domain)


@dataclass(frozen=True)
class _Piece:
    """What one element loop stores: ``value`` into output ``j`` (all of it, or one part of a cat),
    element ``idx`` of the value going to element ``to_out(idx)`` of the output."""

    j: int
    value: Value
    to_out: Callable[[Index], Index] | None = None  # None: the same index


def _reductions_under(v: Value, seen: set[int], out: list[Reduce], stop_at_reduce: bool) -> None:
    if id(v) in seen:
        return
    seen.add(id(v))
    if isinstance(v, Reduce):
        out.append(v)
        if stop_at_reduce:
            return
        _reductions_under(v.src, seen, out, stop_at_reduce)
    elif isinstance(v, Op):
        for a in v.args:
            _reductions_under(a, seen, out, stop_at_reduce)
    elif isinstance(v, View):
        _reductions_under(v.src, seen, out, stop_at_reduce)
    elif isinstance(v, Select):
        for p in v.parts:
            _reductions_under(p, seen, out, stop_at_reduce)


def _domain_of(red: Reduce) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    shape, dims, n = red.src.shape, red.dims, len(red.src.shape)
    k = n - len(dims)
    if dims == tuple(range(k, n)):
        return "rows", shape[:k], shape[k:]
    if dims == tuple(range(len(dims))):
        return "cols", shape[: len(dims)], shape[len(dims):]
    raise Unsupported(f"reduction over axes {list(dims)} of a {list(shape)} tensor (only leading or trailing)")


class _Scheduler:
    def __init__(self, values: GraphValues, out_strides: Sequence[tuple[int, ...]] = ()) -> None:
        self.values = values
        # Strides of each output buffer (``output_strides``); missing ones are contiguous.
        self.out_strides = list(out_strides)
        reds: list[Reduce] = []
        seen: set[int] = set()
        for out in values.outputs:
            _reductions_under(out, seen, reds, stop_at_reduce=False)
        self.deps = {id(r): self._direct_deps(r) for r in reds}
        self.plans: list[_Plan] = []
        self.home: dict[int, _Plan] = {}
        depth: dict[int, int] = {}
        self.depth = depth  # read by _plan while it fills
        for red in _topo(reds, self.deps):
            kind, rows, cols = _domain_of(red)
            plan_key_depth = 0
            if kind == "cols":  # a column reduction reading another one of the same domain runs after it
                same = [depth[d] for d in self.deps[id(red)] if self._key(self.home[d]) == (kind, rows, cols)]
                plan_key_depth = 1 + max(same, default=0)
            depth[id(red)] = plan_key_depth
            plan = self._plan(kind, rows, cols, plan_key_depth)
            plan.reductions.append(red)
            self.home[id(red)] = plan
        self._assign_outputs()

    def _direct_deps(self, red: Reduce) -> set[int]:
        found: list[Reduce] = []
        _reductions_under(red.src, set(), found, stop_at_reduce=True)
        return {id(r) for r in found}

    @staticmethod
    def _key(plan: _Plan) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return plan.kind, plan.row_shape, plan.col_shape

    def _plan(self, kind: str, rows: tuple[int, ...], cols: tuple[int, ...], depth: int = 0) -> _Plan:
        for plan in self.plans:
            if self._key(plan) == (kind, rows, cols) and (kind == "rows" or self.depth_of(plan) == depth):
                return plan
        plan = _Plan(kind, rows, cols)
        self.plans.append(plan)
        return plan

    def depth_of(self, plan: _Plan) -> int:
        return self.depth.get(id(plan.reductions[0]), 0) if plan.reductions else 0

    def _assign_outputs(self) -> None:
        # Outputs computed without reductions: value id → (the plans whose kernels store it, j).
        self.stored_by: dict[int, tuple[list[_Plan], int]] = {}
        for j, out in enumerate(self.values.outputs):
            if isinstance(out, Reduce):
                continue  # stored where it is computed
            rows_plans = [p for p in self.plans if p.kind == "rows"]
            full = next((p for p in rows_plans if out.shape == p.row_shape + p.col_shape), None)
            if full is not None:
                full.full_outputs.append(_Piece(j, out))
                if not _reductions_in(out):
                    self.stored_by[id(out)] = ([full], j)
                continue
            row = next((p for p in rows_plans if _is_row_shape(out.shape, p)), None)
            if row is not None:
                row.row_outputs.append(j)
                continue
            if (viewing := self._plan_viewing(out)) is not None:
                plan, piece = viewing
                plan.full_outputs.append(_Piece(j, *piece))
                if not _reductions_in(out):
                    self.stored_by[id(out)] = ([plan], j)
                continue
            plans = []
            for whole in _pieces(j, out):
                for piece in _split_at_cats(_affine_columns(whole)):
                    plans.append(self._pointwise_plan(piece.value.shape))
                    plans[-1].full_outputs.append(piece)
            if not _reductions_in(out):
                # A kernel that needs this value may load it once the kernels storing it have run.
                self.stored_by[id(out)] = (plans, j)

    def _plan_viewing(self, out: Value) -> tuple[_Plan, tuple[Value, Callable[[Index], Index]]] | None:
        """A rows plan that already stores a full output over the same elements as ``out`` in another
        shape, with ``out``'s trailing axes as its columns: a value and its ``view`` both returned (a
        linear's input gradient, once flat for the weight's product and once shaped for the residual).
        The one loop stores both, instead of a loop each. Returns the plan and ``out`` seen in its shape
        (the value, and the map back to ``out``'s elements)."""
        if isinstance(out, Select) or _reductions_in(out):  # one reading other kernels' sums: its own loop
            return None
        for plan in self.plans:
            k = len(plan.col_shape)
            if plan.kind != "rows" or not plan.full_outputs or not 0 < k <= len(out.shape):
                continue
            if tuple(out.shape[len(out.shape) - k:]) != plan.col_shape:
                continue
            if math.prod(out.shape[:len(out.shape) - k]) != math.prod(plan.row_shape):
                continue
            shape = plan.row_shape + plan.col_shape
            back = reshape_map(out.shape, shape)
            return plan, (View(out, back, shape, out.dtype), back)
        return None

    def _pointwise_plan(self, shape: tuple[int, ...]) -> _Plan:
        split = len(shape) - 1 if shape else 0
        while split > 0 and math.prod(shape[split:]) < MIN_POINTWISE_COLS:
            split -= 1  # a short last axis (a cat of pairs: 2) is too short an inner loop
        return self._plan("rows", shape[:split], shape[split:])

    def program(self) -> LoopProgram:
        values = self.values
        buffers = [Buffer(f"in{i.position}", "input", i.shape, i.stride, i.dtype) for i in values.inputs]
        out_buffer: dict[int, str] = {}
        self.also_stored: dict[int, list[str]] = {}  # a reduction that is several outputs
        for j, out in enumerate(values.outputs):
            stride = self.out_strides[j] if j < len(self.out_strides) else contiguous_strides(out.shape)
            buffers.append(Buffer(f"out{j}", "output", out.shape, stride, out.dtype))
            if isinstance(out, Reduce):
                if id(out) in out_buffer:
                    self.also_stored.setdefault(id(out), []).append(f"out{j}")
                out_buffer.setdefault(id(out), f"out{j}")
        materialize: set[int] = set()
        for _ in range(8):  # grow the set of reductions read outside their kernel to a fixed point
            temps: dict[int, Buffer] = {}
            for red_id in sorted(materialize, key=self._red_order):
                if red_id not in out_buffer:
                    red = self._red(red_id)
                    temps[red_id] = Buffer(f"tmp{len(temps)}", "temp", red.shape, contiguous_strides(red.shape),
                                           torch.float32 if red.ctype == "f32" else torch.int64)
            red_buffers = {**{k: b.name for k, b in temps.items()}, **out_buffer}
            self.buffer_strides = {b.name: b.stride for b in buffers + list(temps.values())}
            kernels, needs, loads_from = [], [], []
            for n, plan in enumerate(self.plans):
                kernel, foreign, stored = _build_kernel(self, plan, f"kernel{n}", red_buffers, materialize)
                kernels.append(kernel)
                needs.append(foreign)
                loads_from.append(stored)
            wanted = set().union(*needs) if needs else set()
            if wanted <= materialize:
                break
            materialize |= wanted
        else:
            raise Unsupported("reductions read across kernels did not settle")
        try:
            order = self._kernel_order(needs, loads_from)
        except Unsupported:
            if not self.stored_by:
                raise
            self.stored_by = {}  # loading stored outputs closed a cycle: compute them again instead
            return self.program()
        return LoopProgram(buffers + list(temps.values()), [kernels[i] for i in order])

    def _red(self, red_id: int) -> Reduce:
        for plan in self.plans:
            for red in plan.reductions:
                if id(red) == red_id:
                    return red
        raise KeyError(red_id)

    def _red_order(self, red_id: int) -> int:
        flat = [id(r) for p in self.plans for r in p.reductions]
        return flat.index(red_id)

    def _kernel_order(self, needs: list[set[int]], loads_from: list[set[int]]) -> list[int]:
        """Kernels in an order where each runs after those whose reductions (``needs``) or stored
        outputs (``loads_from``, plan ids) it reads."""
        index = {id(p): n for n, p in enumerate(self.plans)}
        after = [{index[id(self.home[r])] for r in need} | {index[p] for p in plans}
                 for need, plans in zip(needs, loads_from, strict=True)]
        order: list[int] = []
        while len(order) < len(self.plans):
            ready = [n for n in range(len(self.plans)) if n not in order and after[n] <= set(order)]
            if not ready:
                raise Unsupported("kernels of the region depend on each other in a cycle")
            order.append(ready[0])
        return order


# A cat output whose parts are at least this long along the cat axis is stored part by part, each
# part by its own loop: one loop over the whole output would compute every part at every element
# and select (q, k and v gradients written into one buffer for the merged projection's backward).
MIN_SPLIT_PART = 8


def _pieces(j: int, out: Value) -> list[_Piece]:
    if not isinstance(out, Select) or min(b - a for a, b in pairwise(out.offsets)) < MIN_SPLIT_PART:
        return [_Piece(j, out)]
    return [_Piece(j, _cast_like(part, out), _shifted(out.dim, lo)) for part, lo in zip(out.parts, out.offsets,
                                                                                    strict=False)]


def _shifted(dim: int, offset: int) -> Callable[[Index], Index]:
    return lambda idx: idx[:dim] + (idx[dim] + offset,) + idx[dim + 1:]


def _affine_columns(piece: _Piece) -> _Piece:
    """Split the last axis of a pointwise piece where its loads jump: when an input's offset holds
    ``s // m`` or ``s % m`` of that axis (a reshape of heads: the k gradient's 2 heads of 32 read
    from a tensor of 6 heads), the axis becomes (n / m, m), so that the inner loop runs over m
    elements at a plain stride instead of dividing per element and gathering."""
    shape = piece.value.shape
    if not shape:
        return piece
    n = shape[-1]
    probe = tuple(sympy.Symbol(f"s{d}", integer=True, nonnegative=True) for d in range(len(shape)))
    moduli = set()
    bounds = dict(zip(probe, shape, strict=True))
    for offset in _load_offsets(piece.value, probe, bounds):
        for atom in offset.atoms(FloorDiv, *MODS):
            m = atom.args[1]
            if probe[-1] in atom.args[0].free_symbols and isinstance(m, sympy.Integer):
                moduli.add(int(m))
    fits = [m for m in moduli if MIN_POINTWISE_COLS <= m < n and n % m == 0]
    if not fits:
        return piece
    m = min(fits)
    new_shape = shape[:-1] + (n // m, m)
    back = reshape_map(shape, new_shape)  # index in new_shape -> index in shape
    value = View(piece.value, back, new_shape, piece.value.dtype)
    to_out = back if piece.to_out is None else (lambda idx, f=piece.to_out: f(back(idx)))
    return _Piece(piece.j, value, to_out)


# At most this many column ranges per piece when it is cut where a cat it reads changes parts.
MAX_CAT_SEGMENTS = 4


def _split_at_cats(piece: _Piece) -> list[_Piece]:
    """Cut the last axis of a pointwise piece where a cat it reads (at a plain shift of that axis)
    changes parts: RoPE's ``rotate_half`` and its backward read one half or the other. Over each
    range the part is known, so the inner loop loads at a plain stride instead of computing both
    halves at every element, clamping their indices and selecting."""
    shape = piece.value.shape
    if not shape:
        return [piece]
    n = shape[-1]
    probe = tuple(sympy.Symbol(f"s{d}", integer=True, nonnegative=True) for d in range(len(shape)))
    breaks = _cat_breaks(piece.value, probe, probe[-1], dict(zip(probe, shape, strict=True)), {})
    if not breaks:
        return [piece]
    points = [0, *sorted(b for b in breaks if 0 < b < n), n]
    if len(points) - 1 > MAX_CAT_SEGMENTS or min(b - a for a, b in pairwise(points)) < MIN_SPLIT_PART:
        return [piece]
    pieces = []
    for a, b in pairwise(points):
        shift = _shifted(len(shape) - 1, a)
        value = View(piece.value, shift, shape[:-1] + (b - a,), piece.value.dtype)
        to_out = shift if piece.to_out is None else (lambda idx, f=piece.to_out, g=shift: f(g(idx)))
        pieces.append(_Piece(piece.j, value, to_out))
    return pieces


def _cat_breaks(v: Value, idx: Index, axis: sympy.Symbol, bounds: dict[sympy.Symbol, int],
                memo: dict) -> set[int] | None:
    """Positions along ``axis`` where a cat that ``v`` reads at element ``idx`` changes parts; None
    when a cat's position depends on ``axis`` other than as ``axis + k`` (no cut helps then)."""
    if not _reads_a_cat(v, memo):
        return set()  # no Select below: nothing to cut, and no clamped indices to build (sympy's Max/Min)
    key = (id(v), idx)
    if key in memo:
        return memo[key]
    found: set[int] | None = set()
    children: list[tuple[Value, Index]] = []
    # Children that read no cat add no breaks: their indices (sympy work) are not built.
    if isinstance(v, View):
        children = [(v.src, v.index_map(idx))]
    elif isinstance(v, Op):
        children = [(a, broadcast_index(idx, v.shape, a.shape)) for a in v.args if _reads_a_cat(a, memo)]
    elif isinstance(v, Select):
        pos = sympy.expand(simplify_index(idx[v.dim], bounds))
        k = pos - axis
        if axis in pos.free_symbols:
            if k.free_symbols or not isinstance(k, sympy.Integer):
                found = None
            else:
                found = {off - int(k) for off in v.offsets[1:-1]}
        children = [(part, idx[: v.dim] + (sympy.Max(0, sympy.Min(pos - lo, hi - lo - 1)),) + idx[v.dim + 1:])
                    for part, lo, hi in zip(v.parts, v.offsets, v.offsets[1:], strict=False)
                    if _reads_a_cat(part, memo)]
    for child, child_idx in children:
        if found is None:
            break
        more = _cat_breaks(child, child_idx, axis, bounds, memo)
        found = None if more is None else found | more
    memo[key] = found
    return found


def _reads_a_cat(v: Value, memo: dict) -> bool:
    """Whether a Select (a cat) is among ``v`` and the values it reads (memoized in ``memo``)."""
    key = ("reads a cat", id(v))
    if key not in memo:
        if isinstance(v, Select):
            memo[key] = True
        elif isinstance(v, Op):
            memo[key] = any(_reads_a_cat(a, memo) for a in v.args)
        elif isinstance(v, View):
            memo[key] = _reads_a_cat(v.src, memo)
        else:  # an input, a constant, or a reduction (its own kernel's value: not cut here)
            memo[key] = False
    return memo[key]


def _load_offsets(v: Value, idx: Index, bounds: dict[sympy.Symbol, int]) -> list[sympy.Expr]:
    """The element offsets a pointwise value reads its inputs at, for element ``idx``."""
    if isinstance(v, Input):
        return [_input_offset(v, idx, bounds)]
    if isinstance(v, View):
        return _load_offsets(v.src, v.index_map(idx), bounds)
    if isinstance(v, Op):
        return [o for a in v.args for o in _load_offsets(a, broadcast_index(idx, v.shape, a.shape), bounds)]
    if isinstance(v, Select):
        pos = idx[v.dim]
        return [o for part, lo in zip(v.parts, v.offsets, strict=False)
                for o in _load_offsets(part, idx[: v.dim] + (pos - lo,) + idx[v.dim + 1:], bounds)]
    return []


def _input_offset(v: Input, idx: Index, bounds: dict[sympy.Symbol, int]) -> sympy.Expr:
    """Element ``idx`` of an input as an offset into its buffer (its strides), simplified."""
    return simplify_index(sum((i * s for i, s in zip(idx, v.stride, strict=True)), sympy.Integer(0)), bounds)


def _cast_like(part: Value, out: Value) -> Value:
    """A cat's part in the cat's dtype (ATen's cat promotes its inputs)."""
    if compute_type(part.dtype) == compute_type(out.dtype):
        return part  # bf16 and fp32 are both computed in fp32; the store rounds
    return Op("cast", (part,), part.shape, out.dtype, compute_type(part.dtype))


def _is_row_shape(shape: tuple[int, ...], plan: _Plan) -> bool:
    return shape == plan.row_shape or shape == plan.row_shape + (1,) * len(plan.col_shape)


def _topo(reds: list[Reduce], deps: dict[int, set[int]]) -> list[Reduce]:
    by_id = {id(r): r for r in reds}
    done: list[Reduce] = []
    placed: set[int] = set()

    def visit(r: Reduce) -> None:
        if id(r) in placed:
            return
        placed.add(id(r))
        for d in sorted(deps[id(r)], key=lambda x: reds.index(by_id[x])):
            visit(by_id[d])
        done.append(r)

    for r in reds:
        visit(r)
    return done


# -- building one kernel ---------------------------------------------------------------------------
MIN_POINTWISE_COLS = 16  # a pointwise kernel's inner loop takes trailing axes until this long
# Row scratch a kernel may keep (all buffers together), and the least recomputation cost worth it.
ROW_CACHE_BYTES = 1 << 16
ROW_CACHE_MIN_COST = 8
MAX_UNROLL = 4


def _reductions_in(v: Value) -> bool:
    found: list[Reduce] = []
    _reductions_under(v, set(), found, stop_at_reduce=True)
    return bool(found)


def _build_kernel(sched: _Scheduler, plan: _Plan, name: str, red_buffers: dict[int, str],
                  materialize: set[int]) -> tuple[Kernel, set[int], set[int]]:
    """The kernel of ``plan``, the reductions it reads from other kernels, and the plans whose stored
    outputs it loads."""
    kb = _KernelBuilder(sched, plan, name, red_buffers, materialize)
    kernel = kb.build()
    unroll = _pair_unroll(kernel)
    if unroll > 1:
        kb = _KernelBuilder(sched, plan, name, red_buffers, materialize, unroll)
        kernel = kb.build()
    return kernel, kb.foreign_reads, kb.loads_from


def _pair_unroll(kernel: Kernel) -> int:
    """How many columns one step of a pointwise kernel should take: ``m`` when its indices split
    ``c`` as ``c // m`` and ``c % m`` for a small ``m`` (an interleaved pair's cat/flatten), so that
    each copy's indices become plain strides and the ``c % m`` selects fold away."""
    if kernel.kind != "rows" or kernel.has_reductions or len(kernel.blocks) == 0:
        return 1
    found = 1
    for block in kernel.blocks:
        exprs = [s.args[1] for s in block.stmts if s.op == "load"] + [s.args[0] for s in block.stmts
                                                                       if s.op == "index"]
        exprs += [st.index for st in block.stores]
        for expr in exprs:
            for atom in sympy.sympify(expr).atoms(FloorDiv, *MODS):
                m = atom.args[1]
                if C in atom.args[0].free_symbols and isinstance(m, sympy.Integer) and 1 < int(m) <= MAX_UNROLL:
                    found = max(found, int(m))
    return found if kernel.cols % found == 0 else 1


class _KernelBuilder:
    def __init__(self, sched: _Scheduler, plan: _Plan, name: str, red_buffers: dict[int, str],
                 materialize: set[int], unroll: int = 1) -> None:
        self.sched, self.plan, self.red_buffers, self.materialize = sched, plan, red_buffers, materialize
        self.kernel = Kernel(name, plan.kind, plan.row_shape, plan.col_shape, unroll=unroll)
        self.row_idx = unravel(R, plan.row_shape)
        self.col_idx = unravel(C, plan.col_shape)
        self.bounds = {R: max(1, math.prod(plan.row_shape)), C: max(1, math.prod(plan.col_shape) // unroll)}
        self.foreign_reads: set[int] = set()
        self.loads_from: set[int] = set()  # ids of plans whose stored outputs this kernel loads
        self.ctypes: dict[str, str] = {}
        self.inner_names: set[str] = set()
        self.memo: dict[tuple[int, Index], str] = {}
        self.cse: dict[tuple[Any, ...], str] = {}
        self.local: dict[int, str] = {}  # reduction → name of its finished per-row (per-column) value
        # Values of earlier inner blocks of this row: key of memo → (block, name), for the row cache.
        self.earlier: dict[tuple[int, Index], tuple[Block, str]] = {}
        self.cached: dict[tuple[int, Index], str] = {}  # key → the row buffer holding it
        self.costs: dict[int, int] = {}
        self.outer = self._open("outer")
        self.inner: Block | None = None
        self.counter = 0

    def _open(self, level: str) -> Block:
        block = Block(level)
        self.kernel.blocks.append(block)
        return block

    # -- the blocks -------------------------------------------------------------------------------
    def build(self) -> Kernel:
        plan, outs = self.plan, self.sched.values.outputs
        full_idx = self.row_idx + self.col_idx
        if plan.kind == "cols":
            self._reduction_pass(plan.reductions, full_idx)
        else:
            stage: dict[int, int] = {}
            for red in plan.reductions:  # already in dependency order
                local = [stage[d] for d in self.sched.deps[id(red)] if d in stage]
                stage[id(red)] = 1 + max(local, default=0)
            for s in sorted(set(stage.values())):
                self._reduction_pass([r for r in plan.reductions if stage[id(r)] == s], full_idx)
        if plan.full_outputs:
            self.inner = self._open("inner")
            u = self.kernel.unroll
            for k in range(u):
                idx = full_idx if u == 1 else self.row_idx + unravel(u * C + k, plan.col_shape)
                for piece in plan.full_outputs:
                    at = idx if piece.to_out is None else piece.to_out(idx)
                    self._store(f"out{piece.j}", outs[piece.j].shape, at, self.value(piece.value, idx))
            self._close_inner()
        for j in plan.row_outputs:
            idx = self.row_idx + (sympy.Integer(0),) * (len(outs[j].shape) - len(self.row_idx))
            self._store(f"out{j}", outs[j].shape, idx, self.value(outs[j], idx))
        self.kernel.blocks = [b for b in self.kernel.blocks if not b.empty()]
        return self.kernel

    def _reduction_pass(self, reds: list[Reduce], full_idx: Index) -> None:
        self.inner = self._open("inner")
        accs = []
        for red in reds:
            value = self._as(self.value(red.src, full_idx), red.ctype)
            acc = self._fresh("acc")
            self.ctypes[acc] = red.ctype
            self.inner.reductions.append(Reduction(acc, red.op, value, red.ctype))
            accs.append(acc)
        self._close_inner()
        for red, acc in zip(reds, accs, strict=True):
            result = acc
            if red.scale is not None:
                result = self._emit("mul", (acc, self._const(red.scale, "f32")), red.ctype)
            self.local[id(red)] = result
            buf = self.red_buffers.get(id(red))
            if buf is not None and (id(red) in self.materialize or buf.startswith("out")):
                idx = self._home_index(red)
                self._store(buf, red.shape, idx, result)
                for other in self.sched.also_stored.get(id(red), []):
                    self._store(other, red.shape, idx, result)

    def _home_index(self, red: Reduce) -> Index:
        """The output index of ``red`` that the current row (rows) or column (cols) computes."""
        kept = iter(self.row_idx if self.plan.kind == "rows" else self.col_idx)
        if not red.keepdim:
            return tuple(kept)
        return tuple(sympy.Integer(0) if d in red.dims else next(kept) for d in range(len(red.src.shape)))

    def _close_inner(self) -> None:
        for key in [k for k, v in self.memo.items() if v in self.inner_names]:
            self.earlier[key] = (self.inner, self.memo.pop(key))
        for key in [k for k, v in self.cse.items() if v in self.inner_names]:
            del self.cse[key]
        self.inner = None
        self.outer = self._open("outer")

    def _store(self, buffer: str, shape: tuple[int, ...], idx: Index, value: str) -> None:
        target = self.inner if self.inner is not None else self.outer
        target.stores.append(Store(buffer, self._offset(buffer, shape, idx), value))

    def _offset(self, buffer: str, shape: tuple[int, ...], idx: Index) -> sympy.Expr:
        """Element ``idx`` of a buffer the program writes, at that buffer's strides."""
        stride = self.sched.buffer_strides.get(buffer)
        if stride is None or stride == contiguous_strides(shape):
            flat = ravel(idx, shape)
        else:
            flat = sum((i * s for i, s in zip(idx, stride, strict=True)), sympy.Integer(0))
        return simplify_index(flat, self.bounds)

    # -- statements -------------------------------------------------------------------------------
    def _fresh(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _emit(self, op: str, args: tuple[Any, ...], ctype: str, depends_on_c: bool = False) -> str:
        key = (op, args, ctype)
        if key in self.cse:
            return self.cse[key]
        inner = depends_on_c or any(isinstance(a, str) and a in self.inner_names for a in args)
        if self.plan.kind == "cols" and self.inner is not None:
            inner = True  # the column pass recomputes everything per (r, c)
        name = self._fresh()
        if inner:
            if self.inner is None:
                raise Unsupported("a per-element value is needed outside the element loop")
            self.inner.stmts.append(Stmt(name, op, args, ctype))
            self.inner_names.add(name)
        else:
            self.outer.stmts.append(Stmt(name, op, args, ctype))
        self.ctypes[name] = ctype
        self.cse[key] = name
        return name

    def _const(self, value: Any, ctype: str) -> str:
        if ctype == "f32":
            value = float(value)
        elif ctype == "bool":
            value = bool(value)
        else:
            value = int(value)
        return self._emit("const", (value,), ctype)

    def _as(self, name: str, ctype: str) -> str:
        return name if self.ctypes[name] == ctype else self._emit("cast", (name,), ctype)

    def value(self, v: Value, idx: Index) -> str:
        key = (id(v), idx)
        if key not in self.memo:
            recalled = self._recall(key, v)
            if recalled is None:
                recalled = self._load_stored(v, idx)
            self.memo[key] = recalled if recalled is not None else self._value(v, idx)
        return self.memo[key]

    def _load_stored(self, v: Value, idx: Index) -> str | None:
        """Load a dear value that another kernel of the region stores as an output (RoPE's cos and
        sin, broadcast over batch and heads) rather than compute it again at every element."""
        stored = self.sched.stored_by.get(id(v))
        if stored is None or any(p is self.plan for p in stored[0]) or self._cost(v) < ROW_CACHE_MIN_COST:
            return None
        plans, j = stored
        buf = f"out{j}"
        self.loads_from |= {id(p) for p in plans}
        offset = self._offset(buf, v.shape, idx)
        return self._emit("load", (buf, offset), v.ctype, depends_on_c=_uses(offset, C))

    def _recall(self, key: tuple[int, Index], v: Value) -> str | None:
        """Load a value an earlier pass over this row computed, if it is dear enough to keep: the
        earlier pass stores it into a row buffer (scratch of one row, in L1 for usual rows)."""
        if key not in self.earlier or self.inner is None or self.plan.kind != "rows" or self.kernel.unroll != 1:
            return None
        block, name = self.earlier[key]
        if key not in self.cached:
            if self._cost(v) < ROW_CACHE_MIN_COST:
                return None
            ctype = self.ctypes[name]
            itemsize = 1 if ctype == "bool" else (8 if ctype == "i64" else 4)
            used = sum(b.shape[0] * b.dtype.itemsize for b in self.kernel.row_buffers)
            if used + itemsize * self.kernel.cols > ROW_CACHE_BYTES:
                return None
            dtype = {"f32": torch.float32, "i64": torch.int64, "i32": torch.int32, "bool": torch.bool}[ctype]
            buf = Buffer(f"row{len(self.kernel.row_buffers)}", "row", (self.kernel.cols,), (1,), dtype)
            self.kernel.row_buffers.append(buf)
            block.stores.append(Store(buf.name, C, name))
            self.cached[key] = buf.name
        return self._emit("load", (self.cached[key], C), self.ctypes[name], depends_on_c=True)

    def _cost(self, v: Value) -> int:
        if id(v) not in self.costs:
            if isinstance(v, Input):
                cost = 1
            elif isinstance(v, View):
                cost = self._cost(v.src)
            elif isinstance(v, Op):  # a cast (no entry in OPS: the code generators write it) costs 1
                cost = (1 if v.op == "cast" else OPS[v.op].cost) + sum(self._cost(a) for a in v.args)
            elif isinstance(v, Select):
                cost = 2 + sum(self._cost(p) for p in v.parts)
            else:  # constants, and reductions (a finished scalar, or one load)
                cost = 0 if isinstance(v, Const) else 1
            self.costs[id(v)] = cost
        return self.costs[id(v)]

    def _value(self, v: Value, idx: Index) -> str:
        if isinstance(v, Input):
            offset = _input_offset(v, idx, self.bounds)
            return self._emit("load", (f"in{v.position}", offset), v.ctype, depends_on_c=_uses(offset, C))
        if isinstance(v, Const):
            return self._const(v.value, v.ctype)
        if isinstance(v, View):
            return self.value(v.src, v.index_map(idx))
        if isinstance(v, Op):
            return self._op(v, idx)
        if isinstance(v, Select):
            return self._select(v, idx)
        if isinstance(v, Reduce):
            return self._reduce_read(v, idx)
        raise Unsupported(f"value {type(v).__name__}")

    def _op(self, v: Op, idx: Index) -> str:
        names = [self.value(a, broadcast_index(idx, v.shape, a.shape)) for a in v.args]
        out_type = compute_type(v.dtype)
        if v.op == "cast":
            return self._emit("cast", (names[0],), out_type) if self.ctypes[names[0]] != out_type else names[0]
        if v.op == "uniform":  # (seed, this element's row-major index in the value's own shape)
            flat = simplify_index(ravel(idx, v.shape), self.bounds)  # one term, not the row split again
            at = self._emit("index", (flat,), "i64", depends_on_c=_uses(flat, C))
            return self._emit("uniform", (self._as(names[0], "i64"), at), "f32")
        if v.op == "where":
            names = [self._as(names[0], "bool")] + [self._as(n, v.operand_type) for n in names[1:]]
        elif v.op in ("round_bf16", "round_f16"):
            names = [self._as(names[0], "f32")]
            out_type = "f32"
        else:
            names = [self._as(n, v.operand_type) for n in names]
        result_type = "bool" if v.op in _BOOL_RESULT else v.operand_type
        if (v.op == "div" and result_type == "f32" and self.plan.kind == "rows" and names[0] in self.inner_names
                and names[1] not in self.inner_names):
            # A per-row divisor: one division per row, a multiplication per element.
            name = self._emit("mul", (names[0], self._emit("reciprocal", (names[1],), "f32")), "f32")
        else:
            name = self._emit(v.op, tuple(names), result_type)
        return self._as(name, out_type)

    def _select(self, v: Select, idx: Index) -> str:
        pos = idx[v.dim]
        n = self._known_part(v, pos)
        if n is not None:  # the part is known (an unrolled copy, a fixed index, a range of columns)
            part_idx = idx[: v.dim] + (pos - v.offsets[n],) + idx[v.dim + 1:]
            return self._as(self.value(v.parts[n], part_idx), compute_type(v.dtype))
        result = None
        for n in reversed(range(len(v.parts))):
            part, lo, hi = v.parts[n], v.offsets[n], v.offsets[n + 1]
            size = hi - lo
            # Clamped, so that the branch not taken still reads inside its tensor.
            local = sympy.Integer(0) if size == 1 else sympy.Max(0, sympy.Min(pos - lo, size - 1))
            part_idx = idx[: v.dim] + (local,) + idx[v.dim + 1:]
            value = self._as(self.value(part, part_idx), compute_type(v.dtype))
            if result is None:
                result = value
                continue
            at = self._emit("index", (pos,), "i64", depends_on_c=_uses(pos, C))
            cond = self._emit("lt", (at, self._const(hi, "i64")), "bool")
            result = self._emit("where", (cond, value, result), compute_type(v.dtype))
        assert result is not None
        return result

    def _known_part(self, v: Select, pos: sympy.Expr) -> int | None:
        """The part of ``v`` holding position ``pos`` for every (r, c) of this kernel, if one does:
        ``pos`` a constant, or growing with r and c (non-negative linear coefficients) so that its
        range is its values at the loop's first and last iteration."""
        pos = simplify_index(pos, self.bounds)
        if pos.free_symbols - {R, C}:
            return None
        if not isinstance(pos, sympy.Integer):
            poly = sympy.Poly(pos, R, C) if pos.is_polynomial(R, C) else None
            if poly is None or poly.total_degree() > 1 or any(c < 0 for c in poly.coeffs()):
                return None
        first = int(pos.subs({R: 0, C: 0}))
        last = int(pos.subs({R: self.bounds[R] - 1, C: self.bounds[C] - 1}))
        for n in range(len(v.parts)):
            if v.offsets[n] <= first and last < v.offsets[n + 1]:
                return n
        return None

    def _reduce_read(self, red: Reduce, idx: Index) -> str:
        home = self.sched.home[id(red)]
        own_idx = self.row_idx if self.plan.kind == "rows" else self.col_idx
        # Simplified: a row reached through a reshape and back (256*(r//256) + r%256) is the row itself.
        kept, own = (tuple(simplify_index(i, self.bounds) for i in ix) for ix in (red.kept_index(idx), own_idx))
        if home is self.plan and id(red) in self.local and kept == own:
            return self.local[id(red)]
        if home is self.plan and id(red) not in self.local:
            raise Unsupported("a reduction is read inside its own pass")
        self.foreign_reads.add(id(red))
        buf = self.red_buffers.get(id(red))
        if buf is None:  # materialised in the next round of scheduling
            return self._const(0, red.ctype)
        offset = self._offset(buf, red.shape, idx)
        return self._emit("load", (buf, offset), red.ctype, depends_on_c=_uses(offset, C))


_BOOL_RESULT = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not"})


def _uses(expr: Any, sym: sympy.Symbol) -> bool:
    if isinstance(expr, tuple):
        return any(_uses(e, sym) for e in expr)
    return sym in getattr(expr, "free_symbols", ())


def cached_program(region: Any) -> LoopProgram:
    """``lower_region`` once per region: the program (or the reason it failed) is kept on the region,
    so an executor's ``decline_reason`` and ``compile`` (and a second code generator) share it."""
    if region.program_error is not None:
        raise Unsupported(region.program_error)
    if region.program is None:
        try:
            region.program = lower_region(region)
        except Unsupported as e:
            region.program_error = str(e)
            raise
    return region.program

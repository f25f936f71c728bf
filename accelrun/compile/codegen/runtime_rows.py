"""Kernels whose number of rows is read at each call: for sizes that change between calls.

A mixture of experts' expert meets a different number of tokens on every call. Dynamo then traces its
graph with that dimension as a symbol (``s0``, or ``u0`` where a mask picked the rows), and kernels
written for fixed sizes could only read the symbol as a number, which makes Dynamo compile the graph
again for every size; past a few compiles such regions stayed unfused ATen calls (the decomposed
SiLU of an expert's backward: slower than eager's own kernel).

Most such regions use the symbol in one place: the leading size of their tensors, the rows a kernel
loops over (``s``, or ``16*s`` where a batch of 16 sequences of length ``s`` is read as rows: a
``[16, s, 256]`` tensor laid out as rows has 16·s of them). Such a region is lowered twice, with two
made-up row counts. When the two programs are the same but for those counts, nothing in any row's
code depends on the count, and the program holds for every count: the C++ kernel loops over as many
rows as its first such input has at that call.
Anything else (the symbol in a stride, past the axes read as rows, in an index or a constant, or more
than one symbol) raises ``Unsupported`` with the reason, and the region keeps the fixed-size rules.

    program = lower_with_runtime_rows(region)    # program.runtime_rows names what has n rows
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from accelrun.compile.codegen.loop_ir import Buffer, Kernel, LoopProgram, Unsupported, lower_graph
from accelrun.compile.codegen.values import reads_only_as_size

# Two made-up row counts: one a prime, one with many small factors, so that no simplification that
# depends on the count's divisibility can hold for both by chance. Neither is a size seen in models.
PROBES = (8191, 12288)
ROWS = -1  # marks "the runtime count" where the two programs are compared


@dataclass(frozen=True)
class RuntimeRows:
    """What of a program has the call's row count ``n`` as its leading size."""

    symbol: str  # Dynamo's name for it, for the explain dump
    input: str  # the input buffer the count is read from (its axis 0, or its leading axes' product)
    buffers: frozenset[str]  # buffers whose axis 0 has n entries (inputs, outputs, temporaries)
    kernels: frozenset[str]  # kernels whose leading row axis has n entries
    # Kernels without rows whose one loop runs over n times the rest of its columns (a pointwise kernel
    # over a tensor with short rows, flattened; a sum of everything).
    flat_kernels: frozenset[str] = frozenset()
    # Buffers whose rows are several leading axes of the region's tensor (a batch of sequences of
    # changing length, [16, s, 256], runs as 16*s rows): those axes, -1 for the changing one. Inputs
    # are viewed as rows and outputs viewed back at each call.
    leading_axes: tuple[tuple[str, tuple[int, ...]], ...] = ()


def symbolic(n: Any) -> bool:
    return not isinstance(n, int)


def lower_with_runtime_rows(region: Any) -> LoopProgram:
    """The region's loop program for any number of rows (raises ``Unsupported`` with the reason)."""
    symbol, rows = row_symbol(region)
    counts = [int(rows.xreplace({symbol: p})) for p in PROBES]  # the rows at each probe
    (first, first_leads), (second, second_leads) = (
        _rows_merged(lower_graph(*_with_rows(region, symbol, p), size_inputs=True), n)
        for p, n in zip(PROBES, counts, strict=True))  # fmt: skip
    if _marked(first, counts[0]) != _marked(second, counts[1]) or first_leads.keys() != second_leads.keys():
        raise Unsupported(f"the changing size {symbol} is used past the rows a kernel loops over (in an index, "
                          "a constant or a column count)")  # fmt: skip
    leads = {}
    for name, one in first_leads.items():
        lead = tuple(-1 if a != b else a for a, b in zip(one, second_leads[name], strict=True))
        if lead.count(-1) != 1:
            raise Unsupported(f"the changing size {symbol} in more than one of a tensor's leading axes")
        leads[name] = lead
    n = counts[0]
    buffers = frozenset(b.name for b in first.buffers if b.shape[:1] == (n,))
    kernels = frozenset(k.name for k in first.kernels if k.row_shape[:1] == (n,))
    flat = frozenset(k.name for k in first.kernels if _flat(k, n))
    source = next((b.name for b in first.of_role("input") if b.name in buffers), None)
    if source is None:
        raise Unsupported(f"no input has the changing size {symbol} as its rows, to read it from")
    for k in first.kernels:
        across = k.name in flat or (k.name in kernels and k.kind == "cols")  # reductions over the n rows
        if across and any(r.op != "sum" for b in k.blocks for r in b.reductions):
            raise Unsupported(f"a max or min over {symbol} rows, which may be none")
        if k.name in flat and (math.prod(k.col_shape[1:]) % k.unroll or k.row_buffers):
            raise Unsupported(f"a loop over {symbol} rows in steps of {k.unroll} columns, or with a scratch row")
    runtime = RuntimeRows(str(symbol), source, buffers, kernels, flat, tuple(sorted(leads.items())))
    return dataclasses.replace(first, runtime_rows=runtime)


def leads_with(t: torch.Tensor, lead: tuple[int, ...], rest: tuple[int, ...]) -> bool:
    """Whether ``t``'s sizes are ``lead`` (-1: any) followed by ``rest``: an input whose leading axes
    are read as the rows (``RuntimeRows.leading_axes``)."""
    shape = tuple(t.shape)
    return (len(shape) == len(lead) + len(rest) and shape[len(lead):] == tuple(rest)
            and all(want in (-1, got) for want, got in zip(lead, shape, strict=False)))  # fmt: skip


def row_symbol(region: Any) -> tuple[sympy.Symbol, sympy.Expr]:
    """The one symbol of the region's sizes, when it is only ever the leading size of a tensor, and that
    leading size: the symbol itself (an expert's tokens), or a whole multiple of it (``16*s``: a batch of
    16 sequences of changing length, flattened to rows)."""
    found: set[sympy.Expr] = set()
    values = _values(region)
    for val in values:
        if not isinstance(val, torch.Tensor):
            continue
        changing = [d for d, n in enumerate(val.shape) if symbolic(n)]
        if len(changing) > 1:
            raise Unsupported(f"changing sizes in {len(changing)} axes of a tensor ({list(val.shape)})")
        if changing:
            (d,) = changing
            expr = val.shape[d].node.expr
            # The axes before it are whole numbers: [16, s, 256] is 16*s rows if laid out as rows
            # (checked on the lowered programs, where its axes are merged or the probes differ).
            if not _multiple_of_a_symbol(expr) or any(symbolic(n) for n in val.shape[:d]):
                raise Unsupported(f"a changing size {expr} that is not a whole number of rows ({list(val.shape)})")
            if not _laid_out_as_rows(val, d):
                raise Unsupported(f"a changing size {expr} past a tensor's leading axis that is not laid out as "
                                  f"rows (sizes {list(val.shape)}, strides {list(val.stride())})")
            found.add(math.prod(val.shape[:d]) * expr)
        # An axis of size 1 is never stepped along: its stride may be anything (nonzero's [n, 1] has n).
        # The axes before the changing one step over it: their strides change with it.
        last = changing[0] if changing else 0
        steps = list(zip(val.shape, val.stride(), strict=True))[last:]
        if any(symbolic(st) and not (isinstance(n, int) and n == 1) for n, st in steps):
            raise Unsupported(f"a changing stride {list(val.stride())} (a transposed tensor of changing size)")
    if len(found) != 1:
        raise Unsupported(f"{len(found)} changing sizes ({', '.join(sorted(map(str, found)))}); kernels read one")
    rows = found.pop()
    if len(rows.free_symbols) != 1:  # 0*s: a tensor with no rows at all (an empty split's piece)
        raise Unsupported(f"a changing size of {rows} rows")
    (symbol,) = rows.free_symbols
    for node in region.gm.graph.nodes:  # a size the region is given: the count itself, as a size only
        val = node.meta.get("val")
        if node.op != "placeholder" or isinstance(val, torch.Tensor):
            continue
        if not isinstance(val, torch.SymInt) or val.node.expr.free_symbols != {symbol}:
            raise Unsupported(f"a number {val} the region is given is not the changing size {symbol}")
        if not all(reads_only_as_size(user, node) for user in node.users):
            raise Unsupported(f"the changing size {symbol} is read as a number (an index, a bound), not as a size")
    return symbol, rows


def _laid_out_as_rows(val: torch.Tensor, d: int) -> bool:
    """Whether axes 0..d of ``val`` step over one another as a row-major tensor's do (axes of size 1
    aside), so that they can be read as one axis of rows. Compared at the probe counts, not as
    expressions: torch writes a fresh tensor's contiguous stride as ``32*Max(1, s)`` where it cannot
    tell that ``s >= 1`` (a size read from a tensor, a mixture of experts' widest expert), which is
    ``32*s`` at every count a kernel runs (at 0 the tensor is empty and has no layout to keep)."""
    symbols = sorted({f for n in (*val.shape, *val.stride()) if symbolic(n) for f in n.node.expr.free_symbols}, key=str)

    def at(n: Any, probe: int) -> int:  # each symbol its own count, so that two never agree by chance
        return int(n.node.expr.xreplace({f: probe + 7 * k for k, f in enumerate(symbols)})) if symbolic(n) else n

    shape, stride = val.shape, val.stride()
    return all(shape[i] == 1 or at(stride[i], p) == at(shape[i + 1], p) * at(stride[i + 1], p)
               for i in range(d) for p in PROBES)  # fmt: skip


def _multiple_of_a_symbol(expr: sympy.Expr) -> bool:
    """``s`` or ``c*s`` with a whole number ``c``: what a row count of changing size is."""
    if isinstance(expr, sympy.Symbol):
        return True
    coeff, rest = expr.as_coeff_Mul()
    return isinstance(rest, sympy.Symbol) and coeff.is_Integer and int(coeff) > 0


def _values(region: Any) -> list[Any]:
    """The region's tensors, and the sizes it is given (inputs that are symbolic integers)."""
    vals = [*region.input_meta, *region.output_meta]
    for node in region.gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            vals += list(val)
        elif val is not None:
            vals.append(val)
    for val in vals:
        if not isinstance(val, (torch.Tensor, torch.SymInt, int)):
            raise Unsupported(f"a value of the region is not a tensor or a size ({type(val).__name__})")
    return vals


def _with_rows(region: Any, symbol: sympy.Symbol, n: int) -> tuple[fx.GraphModule, list, list]:
    """A copy of the region's graph, inputs and outputs whose tensors have ``n`` rows (fake tensors:
    nothing is allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def size(s: Any) -> int:
        return int(s.node.expr.xreplace({symbol: n})) if symbolic(s) else s

    def concrete(val: Any) -> Any:
        if not isinstance(val, torch.Tensor):
            return size(val)
        with mode:
            return torch.empty_strided([size(s) for s in val.shape], [size(s) for s in val.stride()], dtype=val.dtype,
                                       device=val.device)  # fmt: skip

    graph = fx.Graph()
    graph.output(graph.graph_copy(region.gm.graph, {}))
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, (torch.Tensor, torch.SymInt)):
            node.meta = {**node.meta, "val": concrete(val)}
        elif isinstance(val, (tuple, list)):  # an op with several outputs
            node.meta = {**node.meta, "val": type(val)(concrete(v) for v in val)}
    gm = fx.GraphModule(region.gm, graph)
    return gm, [concrete(m) for m in region.input_meta], [concrete(m) for m in region.output_meta]


def _rows_merged(program: LoopProgram, n: int) -> tuple[LoopProgram, dict[str, tuple[int, ...]]]:
    """``program`` with each buffer whose leading axes hold ``n`` elements laid out as rows (``[16, s,
    256]``, contiguous over 16 and s) taken as ``n`` rows, and each kernel whose leading row or column
    axes multiply to ``n`` looping over ``n``; and the merged buffers' leading axes. A kernel's code
    reads its rows through the flat row index, so only the loop's length changes; a buffer whose axes
    cannot be merged keeps its shape, and then the two probes' programs differ (``Unsupported``)."""
    leads: dict[str, tuple[int, ...]] = {}

    def buffer(b: Buffer) -> Buffer:
        k = _prefix(b.shape, n)
        if k is None or not all(b.shape[i] == 1 or b.stride[i] == b.shape[i + 1] * b.stride[i + 1] for i in range(k)):
            return b
        leads[b.name] = b.shape[: k + 1]
        return dataclasses.replace(b, shape=(n, *b.shape[k + 1 :]), stride=(b.stride[k], *b.stride[k + 1 :]))

    def kernel(k: Kernel) -> Kernel:
        if (j := _prefix(k.row_shape, n)) is not None:
            return dataclasses.replace(k, row_shape=(n, *k.row_shape[j + 1 :]))
        if k.kind == "rows" and k.row_shape == () and (j := _prefix(k.col_shape, n)) is not None:
            return dataclasses.replace(k, col_shape=(n, *k.col_shape[j + 1 :]))
        return k

    merged = LoopProgram([buffer(b) for b in program.buffers], [kernel(k) for k in program.kernels],
                         program.runtime_rows, program.size_inputs)  # fmt: skip
    return merged, leads


def _prefix(shape: tuple[int, ...], n: int) -> int | None:
    """The last of two or more leading axes whose sizes multiply to ``n``, if there is one."""
    total = 1
    for i, size in enumerate(shape):
        total *= size
        if total == n:
            return i if i > 0 else None
        if total > n:
            return None
    return None


def _flat(k: Kernel, n: int) -> bool:
    return k.kind == "rows" and k.row_shape == () and k.col_shape[:1] == (n,)


def _marked(program: LoopProgram, n: int) -> LoopProgram:
    """``program`` with each leading size ``n`` written as ``ROWS``: equal for two counts when nothing
    else depends on them."""

    def buffer(b: Buffer) -> Buffer:
        stride = tuple(0 if size == 1 else st for size, st in zip(b.shape, b.stride, strict=True))  # never used
        return dataclasses.replace(b, shape=(ROWS, *b.shape[1:]) if b.shape[:1] == (n,) else b.shape, stride=stride)

    def kernel(k: Kernel) -> Kernel:
        if _flat(k, n):
            return dataclasses.replace(k, col_shape=(ROWS, *k.col_shape[1:]))
        return dataclasses.replace(k, row_shape=(ROWS, *k.row_shape[1:])) if k.row_shape[:1] == (n,) else k

    return LoopProgram([buffer(b) for b in program.buffers], [kernel(k) for k in program.kernels])

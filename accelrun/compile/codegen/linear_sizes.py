"""Kernels whose sizes follow one changing length: the length is read at each call.

Runtime rows (``codegen.runtime_rows``) take a changing size that is only ever the rows a kernel loops
over. In the graph Dynamo traces for any sequence length, other regions have the length inside their
index arithmetic: a transposed ``[B, H, s, hd]`` view of ``[B, s, H, hd]`` (RoPE's q and k), the
``[s, B, D]`` layout ``nn.MultiheadAttention`` works in. Where every size and stride of such a region
is ``a·s + b`` for whole numbers ``a`` and ``b``, the region is lowered and its C++ written at three
made-up lengths (``PROBES``: two primes and one with many small factors, so that no simplification
that depends on the length's divisibility can hold for all three by chance). When the three sources
are the same text but for whole numbers, and each number that differs is ``a·s + b`` across the
three, the source holds for every length with those numbers written as expressions of the kernel's
``n`` argument, which the call sets to the length. Anything else (a different loop plan, a float
that depends on the length, a scratch row of changing size) raises ``Unsupported`` with the reason.

    program = lower_with_linear_sizes(region)    # program.linear_sizes: the source and the layouts
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from accelrun.compile.codegen.loop_ir import LoopProgram, Unsupported, lower_graph
from accelrun.compile.codegen.runtime_rows import _values, _with_rows, symbolic
from accelrun.compile.codegen.values import reads_only_as_size

PROBES = (8191, 12288, 10007)  # long: a compiled region is also run at short lengths when built (short_lengths)
ENTRY_MARK = "accelrun_linear_entry"  # the entry's name in the template, replaced by each library's own
# A whole number standing alone in C++ (not part of a name, a float or INT64_C(...), rewritten first).
_WHOLE = re.compile(r"(?<![\w.])(\d+)(?![\w.])")
_INT64_C = re.compile(r"INT64_C\((-?\d+)\)")  # the sign stays in the text: -(n) for -8191
_DIVIDED_BY_LENGTH = re.compile(r"[/%] \((\d+ \* )?n( [+-] \d+)?\)")  # Linear.cpp's forms
_COLUMN = re.compile(r"\b(c|c0|c1)\b")  # the kernels' inner-loop index (codegen/cpp.py's loops)


@dataclass(frozen=True)
class Linear:
    """``a·s + b``: a size or stride of a buffer, or a whole number of the source, at length ``s``."""

    a: int
    b: int

    def at(self, s: int) -> int:
        return self.a * s + self.b

    def cpp(self) -> str:
        if self.a == 0:
            return str(self.b)
        term = "n" if self.a == 1 else f"{self.a} * n"
        return f"({term} {'+' if self.b >= 0 else '-'} {abs(self.b)})" if self.b else f"({term})"


@dataclass(frozen=True)
class BufferLayout:
    name: str
    shape: tuple[Linear, ...]
    stride: tuple[Linear, ...]

    def at(self, s: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(x.at(s) for x in self.shape), tuple(x.at(s) for x in self.stride)


@dataclass(frozen=True)
class LinearSizes:
    """What a program of sizes linear in the length needs at each call."""

    symbol: str  # Dynamo's name for the length, for the explain dump
    template: str  # the kernels' C++ (no prelude), the entry named ENTRY_MARK, the length as ``n``
    layouts: tuple[BufferLayout, ...]  # every buffer's sizes and strides, in the program's order
    read_from: tuple[str, int]  # the input buffer and axis the length is read from

    def source(self, entry: str) -> str:
        return self.template.replace(ENTRY_MARK, entry)


def fit(values: tuple[int, ...], probes: tuple[int, ...] = PROBES) -> Linear | None:
    """The ``a·s + b`` that takes the probes to ``values``, or None where no whole numbers do."""
    a, rest = divmod(values[1] - values[0], probes[1] - probes[0])
    if rest:
        return None
    line = Linear(a, values[0] - a * probes[0])
    return line if all(line.at(p) == v for p, v in zip(probes, values, strict=True)) else None


def length_symbol(region: Any) -> sympy.Symbol:
    """The one symbol of the region's sizes, where every size and stride is linear in it."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found: set[sympy.Symbol] = set()
    for val in _values(region):
        sizes = [*val.shape, *val.stride()] if isinstance(val, torch.Tensor) else [val]
        for n in sizes:
            if not symbolic(n):
                continue
            if free_unbacked_symbols(n):
                raise Unsupported(f"a size read from the data ({n})")
            expr = n.node.expr
            found |= expr.free_symbols
            if not all(expr.is_polynomial(x) and sympy.degree(expr, x) <= 1 for x in expr.free_symbols):
                raise Unsupported(f"a size {expr} that is not a whole multiple of the length plus a number")
    if len(found) != 1:
        raise Unsupported(f"{len(found)} changing sizes ({', '.join(sorted(map(str, found)))}); kernels read one")
    (symbol,) = found
    for node in region.gm.graph.nodes:  # a size the region is given is read only as a size
        val = node.meta.get("val")
        if node.op == "placeholder" and not isinstance(val, torch.Tensor):
            if not all(reads_only_as_size(user, node) for user in node.users):
                raise Unsupported(f"the changing size {symbol} is read as a number (an index, a bound), not as a size")
    return symbol


def lower_with_linear_sizes(region: Any) -> LoopProgram:
    """The region's program for any length (raises ``Unsupported`` with the reason)."""
    from accelrun.compile.codegen.cpp import cpp_source

    symbol = length_symbol(region)
    programs = [lower_graph(*_with_rows(region, symbol, p), size_inputs=True) for p in PROBES]
    for program in programs[1:]:
        if [(b.name, b.role, b.dtype) for b in program.buffers] != [(b.name, b.role, b.dtype) for b in programs[0].buffers]:
            raise Unsupported(f"the changing size {symbol} changes the region's buffers")
    plans = [[(k.name, [b.shape for b in k.row_buffers]) for k in p.kernels] for p in programs]
    if any(plan != plans[0] for plan in plans[1:]):
        raise Unsupported(f"the changing size {symbol} changes the kernels' loop plan or a scratch row's length")
    sources = [_INT64_C.sub(r"((int64_t)\1)", cpp_source(p, ENTRY_MARK, prelude=False)) for p in programs]
    template = _template(sources, str(symbol))
    if _refused_division(template):
        raise Unsupported(f"an index divided by a multiple of the changing size {symbol} (a division per element, "
                          "slower than the decomposed ops)")  # fmt: skip
    layouts = tuple(_layout(bufs) for bufs in zip(*(p.buffers for p in programs), strict=True))
    read_from = next(((lay.name, d) for lay, b in zip(layouts, programs[0].buffers, strict=True) if b.role == "input"
                      for d, x in enumerate(lay.shape) if x.a > 0), None)  # fmt: skip
    if read_from is None:
        raise Unsupported(f"no input has the changing size {symbol} in its sizes, to read it from")
    sizes = LinearSizes(str(symbol), template, layouts, read_from)
    return dataclasses.replace(programs[0], linear_sizes=sizes)


def _refused_division(template: str) -> bool:
    """Whether the kernels divide an index that varies along their inner loop (over ``c``) by the
    length, or divide by an ``a·n - b`` that is not above 0 at every length. A row's index (``r``: a
    ``[B, s, D]`` tensor read from one laid out ``[s, B, D]``, whose row ``r`` is ``(r / s, r % s)``) is
    divided once per row, outside the inner loop (every kernel loops over ``c`` inside its loop over
    ``r``, and g++ hoists what does not change with ``c``): a few nanoseconds for a row of hundreds of
    elements."""
    for match in _DIVIDED_BY_LENGTH.finditer(template):
        a = int(match.group(1).split()[0]) if match.group(1) else 1
        if a + int((match.group(2) or "0").replace(" ", "")) < 1:  # the divisor at n = 1, its smallest
            return True
        end = match.start() - 1  # the space before the operator
        if template[end - 1] == ")":  # a parenthesised dividend: back to its opening parenthesis
            depth, start = 0, end - 1
            while start >= 0:
                depth += {")": 1, "(": -1}.get(template[start], 0)
                if depth == 0:
                    break
                start -= 1
        else:
            start = end - 1
            while start > 0 and (template[start - 1].isalnum() or template[start - 1] == "_"):
                start -= 1
        if _COLUMN.search(template[start:end]):
            return True
    return False


def _template(sources: list[str], symbol: str) -> str:
    pieces = [_WHOLE.split(s) for s in sources]  # text, number, text, number, ..., text
    if any(len(p) != len(pieces[0]) for p in pieces[1:]):
        raise Unsupported(f"the changing size {symbol} changes the kernels' loop plan")
    out = []
    for i, parts in enumerate(zip(*pieces, strict=True)):
        if i % 2 == 0:
            if any(p != parts[0] for p in parts[1:]):
                raise Unsupported(f"the changing size {symbol} changes the kernels' code (a float, an unroll)")
            out.append(parts[0])
            continue
        values = tuple(int(p) for p in parts)
        if len(set(values)) == 1:
            out.append(parts[0])
            continue
        line = fit(values)
        if line is None:
            raise Unsupported(f"a number of the kernels' code that follows the changing size {symbol} otherwise "
                              f"than a·{symbol} + b ({', '.join(parts)} at {symbol} = {', '.join(map(str, PROBES))})")
        out.append(line.cpp())
    return "".join(out)


def _layout(buffers: tuple[Any, ...]) -> BufferLayout:
    def fitted(values: tuple[int, ...]) -> Linear:
        line = fit(values)
        if line is None:
            raise Unsupported(f"buffer {buffers[0].name}'s layout is not linear in the changing size")
        return line

    shape = tuple(fitted(v) for v in zip(*(b.shape for b in buffers), strict=True))
    stride = tuple(fitted(v) for v in zip(*(b.stride for b in buffers), strict=True))
    return BufferLayout(buffers[0].name, shape, stride)

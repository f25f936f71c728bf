"""The loop IR's pointwise ops: one table, and the renderer base class both code generators extend.

Every op the loop IR can hold is a row of ``OPS``: its arity, its rough cost (relative to an add: what
decides whether a value is kept in a row buffer or recomputed), whether it compares, and, for ops that
are others put together, how (``compose``). A renderer (``codegen.cpp``, ``codegen.triton``) lists its
*primitives* (an expression template per op it spells itself) and says why it lacks any op it cannot
express; everything else is rendered through ``compose``. So NaN-propagating max/min, sigmoid and rsqrt
are written once here, and ``tests/compile/test_op_table.py`` fails when a renderer lacks an op of the
table without a stated reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar


class Unsupported(Exception):
    """The loop IR (or a code generator) cannot express this region; the executor declines with the message."""


@dataclass(frozen=True)
class OpInfo:
    arity: int
    cost: int = 1  # relative to an add
    comparison: bool = False  # yields a boolean from operands of a common type
    # Builds the op from other ops of the table through a renderer, for renderers without a primitive.
    compose: Callable[[Renderer, tuple[str, ...]], str] | None = None


def _nan_max(r: Renderer, a: tuple[str, ...]) -> str:
    # A NaN wins, as in eager's maximum / amax (C++'s std::max and OpenMP's max drop it).
    x, y = a
    return r.op("where", r.op("or", r.op("ne", x, x), r.op("gt", x, y)), x, y)


def _nan_min(r: Renderer, a: tuple[str, ...]) -> str:
    x, y = a
    return r.op("where", r.op("or", r.op("ne", x, x), r.op("lt", x, y)), x, y)


def _sigmoid(r: Renderer, a: tuple[str, ...]) -> str:
    return r.op("div", r.one, r.op("add", r.one, r.op("exp", r.op("neg", a[0]))))


def _rsqrt(r: Renderer, a: tuple[str, ...]) -> str:
    return r.op("div", r.one, r.op("sqrt", a[0]))


def _reciprocal(r: Renderer, a: tuple[str, ...]) -> str:
    return r.op("div", r.one, a[0])


def _one_plus_erf(r: Renderer, a: tuple[str, ...]) -> str:
    return r.op("add", r.op("erf", a[0]), r.one)


OPS: dict[str, OpInfo] = {
    "add": OpInfo(2), "sub": OpInfo(2), "mul": OpInfo(2), "div": OpInfo(2, cost=4), "pow": OpInfo(2, cost=20),
    "maximum": OpInfo(2, compose=_nan_max), "minimum": OpInfo(2, compose=_nan_min),
    "eq": OpInfo(2, comparison=True), "ne": OpInfo(2, comparison=True), "lt": OpInfo(2, comparison=True),
    "le": OpInfo(2, comparison=True), "gt": OpInfo(2, comparison=True), "ge": OpInfo(2, comparison=True),
    "and": OpInfo(2), "or": OpInfo(2), "not": OpInfo(1),
    "neg": OpInfo(1), "abs": OpInfo(1), "exp": OpInfo(1, cost=10), "log": OpInfo(1, cost=10),
    "log1p": OpInfo(1, cost=12), "expm1": OpInfo(1, cost=12), "tanh": OpInfo(1, cost=12),
    "sigmoid": OpInfo(1, cost=12, compose=_sigmoid), "rsqrt": OpInfo(1, cost=4, compose=_rsqrt),
    "sqrt": OpInfo(1, cost=4), "erf": OpInfo(1, cost=12),
    "one_plus_erf": OpInfo(1, cost=12, compose=_one_plus_erf),  # a GELU's cdf: codegen.values makes it
    "reciprocal": OpInfo(1, cost=4, compose=_reciprocal),
    "sin": OpInfo(1, cost=12), "cos": OpInfo(1, cost=12), "floor": OpInfo(1), "ceil": OpInfo(1),
    "trunc": OpInfo(1), "sign": OpInfo(1),
    "round_bf16": OpInfo(1), "round_f16": OpInfo(1),  # a float32 value rounded to the narrower type
    "where": OpInfo(3),
    # dropout's numbers in [0, 1) from (seed, the element's flat index): fused/dropout.py
    "uniform": OpInfo(2, cost=16),
}  # fmt: skip

COMPARISONS = frozenset(name for name, info in OPS.items() if info.comparison)

# Spelled alike in C and in Python (Triton): every renderer starts from these.
INFIX = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})", "neg": "(-{0})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})",
}  # fmt: skip


class Renderer:
    """A backend's spelling of the table. Subclasses set ``name``, ``one`` (the literal 1 of its float
    type), ``primitives`` and ``missing``; ``op`` renders any op of the table."""

    name: ClassVar[str]
    one: ClassVar[str]
    primitives: ClassVar[dict[str, str]]  # op → template over its operands {0}, {1}, {2}
    missing: ClassVar[dict[str, str]] = {}  # op → why this backend has no form for it

    def op(self, name: str, *args: str) -> str:
        if (template := self.primitives.get(name)) is not None:
            return template.format(*args)
        info = OPS.get(name)
        if info is None or info.compose is None:
            why = self.missing.get(name, "not in its primitives")
            raise Unsupported(f"op {name} has no {self.name} form ({why})")
        return info.compose(self, args)

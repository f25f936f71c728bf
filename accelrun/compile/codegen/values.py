"""A region's ATen graph as a DAG of index-addressable values (the front half of the loop IR).

Every value answers "what is element ``idx`` of you?" in terms of other values, so broadcasting and
view ops become index arithmetic and nothing between inputs, reductions and outputs is materialised.
Reductions stay explicit (``Reduce``): the scheduler in ``loop_ir`` decides where each is computed.

Index expressions are sympy integer expressions over the loop variables of the kernel that asks.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from accelrun.compile.codegen.index_simplify import IndexMod
from accelrun.compile.codegen.ops import COMPARISONS, OPS, Unsupported  # noqa: F401  (Unsupported re-exported)
from accelrun.compile.fused import dropout  # noqa: F401  (registers accelrun::dropout_uniform)
from accelrun.torch_private import FloorDiv

aten = torch.ops.aten
prims = torch.ops.prims

Index = tuple[sympy.Expr, ...]


# Compute types: every float is computed in fp32 (bf16 is widened on load, rounded on store).
_COMPUTE = {
    torch.float32: "f32", torch.bfloat16: "f32", torch.float16: "f32",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i32", torch.int8: "i32", torch.uint8: "i32",
    torch.bool: "bool",
}  # fmt: skip


# Integers narrower than their compute type (i32): a result of these ops wraps at its own width in eager
# (uint8 200 * 2 is 144), and here would not until stored; ops whose result is within the operands' range
# stay.
NARROW_INTEGERS = (torch.int16, torch.int8, torch.uint8)
WITHIN_OPERANDS = frozenset({"where", "maximum", "minimum"})
# Integer pow computed through double rounds above 2**53 and saturates where eager wraps: left to ATen.
FLOAT_ONLY = frozenset({"pow"})


def check_integer_op(op: str, dtype: torch.dtype) -> None:
    """Unsupported for an integer op whose kernel would not give eager's result (a fuzzer's findings)."""
    if dtype in NARROW_INTEGERS and op not in WITHIN_OPERANDS:
        raise Unsupported(f"{op} with a {str(dtype).replace('torch.', '')} result (eager wraps it at that width)")
    if op in FLOAT_ONLY and not dtype.is_floating_point:
        raise Unsupported(f"{op} with a {str(dtype).replace('torch.', '')} result (computed in double here)")


def compute_type(dtype: torch.dtype) -> str:
    if dtype not in _COMPUTE:
        raise Unsupported(f"dtype {str(dtype).replace('torch.', '')} is not supported")
    return _COMPUTE[dtype]


class Value:
    shape: tuple[int, ...]
    dtype: torch.dtype  # what eager PyTorch would produce

    @property
    def ctype(self) -> str:
        return compute_type(self.dtype)


@dataclass(eq=False)
class Input(Value):
    position: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(eq=False)
class Const(Value):
    value: float | int | bool
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(eq=False)
class Op(Value):
    """A pointwise op of the IR vocabulary (see ``codegen.ops.OPS``) over broadcast operands."""

    op: str
    args: tuple[Value, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    operand_type: str  # compute type the operands are cast to before the op


@dataclass(eq=False)
class View(Value):
    """Element ``idx`` of this value is element ``index_map(idx)`` of ``src``."""

    src: Value
    index_map: Callable[[Index], Index]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(eq=False)
class Select(Value):
    """``cat`` along ``dim``: part i covers [offsets[i], offsets[i+1]) of that axis."""

    parts: tuple[Value, ...]
    dim: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(eq=False)
class Reduce(Value):
    op: str  # sum | max | min
    src: Value
    dims: tuple[int, ...]  # sorted axes of src that are folded
    keepdim: bool
    scale: float | None  # mean = sum * (1 / count)
    shape: tuple[int, ...]
    dtype: torch.dtype

    def kept_index(self, idx: Index) -> Index:
        """The output index restricted to the axes that survive the reduction."""
        if self.keepdim:
            return tuple(i for d, i in enumerate(idx) if d not in self.dims)
        return tuple(idx)




def broadcast_index(idx: Index, out_shape: Sequence[int], in_shape: Sequence[int]) -> Index:
    """Index into an operand of shape ``in_shape`` broadcast to ``out_shape`` (numpy rules)."""
    lead = len(out_shape) - len(in_shape)
    return tuple(
        sympy.Integer(0) if size == 1 and out_shape[lead + d] != 1 else idx[lead + d]
        for d, size in enumerate(in_shape)
    )


def unravel(flat: sympy.Expr, shape: Sequence[int]) -> Index:
    """Row-major index of ``flat`` in ``shape``; the leading non-trivial axis needs no modulo."""
    return _unravel(flat, tuple(shape))


@functools.lru_cache(maxsize=4096)  # the same views recur in every block and both directions
def _unravel(flat: sympy.Expr, shape: tuple[int, ...]) -> Index:
    first = next((d for d, s in enumerate(shape) if s != 1), len(shape))
    out: list[sympy.Expr] = []
    step = 1
    for d in reversed(range(len(shape))):
        if shape[d] == 1:
            out.append(sympy.Integer(0))
            continue
        q = FloorDiv(flat, step) if step != 1 else flat
        out.append(q if d == first else IndexMod(q, shape[d]))
        step *= shape[d]
    return tuple(reversed(out))


def ravel(idx: Index, shape: Sequence[int]) -> sympy.Expr:
    flat, step = sympy.Integer(0), 1
    for d in reversed(range(len(shape))):
        flat += idx[d] * step
        step *= shape[d]
    return flat


def reshape_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> Callable[[Index], Index]:
    """Index map of a view from ``in_shape`` to ``out_shape``, done group by group.

    Non-trivial axes are grouped where running products agree, so a split or a merge costs a division
    only inside its own group and untouched axes map one to one.
    """
    zeros = tuple(sympy.Integer(0) for _ in in_shape)
    if math.prod(in_shape) == 0:
        return lambda idx: zeros
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = o = 0
    while i < len(ins) and o < len(outs):
        gi, go = [ins[i]], [outs[o]]
        pi, po = in_shape[ins[i]], out_shape[outs[o]]
        i, o = i + 1, o + 1
        while pi != po:
            if pi < po:
                gi.append(ins[i])
                pi, i = pi * in_shape[ins[i]], i + 1
            else:
                go.append(outs[o])
                po, o = po * out_shape[outs[o]], o + 1
        groups.append((gi, go))

    def index_map(idx: Index) -> Index:
        res = list(zeros)
        for gi, go in groups:
            flat = ravel(tuple(idx[d] for d in go), [out_shape[d] for d in go])
            for d, e in zip(gi, unravel(flat, [in_shape[d] for d in gi]), strict=True):
                res[d] = e
        return tuple(res)

    return index_map


# Sizes the user marked dynamic (torch._dynamo.mark_dynamic) in the graph being compiled: reading one as a
# number is Dynamo's guard that fixes it, which Dynamo then refuses ("you marked ... as dynamic but your
# code specialized it": a fuzzer's x * 2 + 1 did not compile). Set by the backend while it compiles.
MARKED_DYNAMIC: contextvars.ContextVar[frozenset[sympy.Symbol]] = contextvars.ContextVar(
    "accelrun_marked_dynamic", default=frozenset())


def fixed(n: Any) -> int:
    """A size as a number: Unsupported (left to ATen) for one the user marked dynamic."""
    if isinstance(n, torch.SymInt) and (marked := MARKED_DYNAMIC.get()):
        if n.node.expr.free_symbols & marked:
            raise Unsupported(f"size {n} is marked dynamic (torch._dynamo.mark_dynamic): kernels here are for "
                              "fixed sizes")
    return int(n)


def _shape(node: Any) -> tuple[int, ...]:
    return tuple(fixed(s) for s in node.meta["val"].shape)


def _dtype(node: Any) -> torch.dtype:
    return node.meta["val"].dtype


def _norm_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    if ndim == 0:
        return ()  # ATen lets dim 0 / -1 name a 0-dim tensor's only "axis": nothing is folded
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({d % ndim for d in dims}))


def _reduced_shape(shape: tuple[int, ...], dims: tuple[int, ...], keepdim: bool) -> tuple[int, ...]:
    return tuple(1 if d in dims else s for d, s in enumerate(shape) if keepdim or d not in dims)


def op_label(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target.overloadpacket.__name__}"
    return getattr(target, "__name__", str(target))


# Ops that may be given a size as an argument, and which argument holds it: they read it only as the
# size of their output, which the lowering takes from the graph's shapes, never from the argument. A
# region's input that is a size and is read only so has no buffer (``GraphValues.size_inputs``).
SIZE_ARGUMENT = {
    aten.expand.default: 1, aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1,
    aten.full.default: 0, torch.ops.accelrun.dropout_uniform.default: 1,
}  # fmt: skip


def reads_only_as_size(user: fx.Node, size: fx.Node) -> bool:
    """Whether ``user`` reads the node ``size`` only within its size argument (``full``'s fill value,
    say, is read as a number)."""
    pos = SIZE_ARGUMENT.get(user.target)
    if pos is None or len(user.args) <= pos:
        return False
    elsewhere: list[fx.Node] = []
    fx.node.map_arg(([a for i, a in enumerate(user.args) if i != pos], dict(user.kwargs)), elsewhere.append)
    return size not in elsewhere


class GraphValues:
    """Translates a region's FX graph into ``Value`` objects (raises ``Unsupported``)."""

    def __init__(self, gm: fx.GraphModule, input_meta: Sequence[Any], size_inputs: bool = False) -> None:
        """``size_inputs``: an input that is a number (a size the region's views and expands are given,
        where the sizes change between calls) is allowed, and read only from the graph's shapes."""
        self.env: dict[fx.Node, Value] = {}
        self.size_inputs: list[int] = []  # positions of such inputs: they have no buffer
        self._canon: dict[int, Value] = {}  # id of a value built by a rule → its interned equal
        self._by_key: dict[tuple[Any, ...], Value] = {}
        self._alive: list[Value] = []  # keeps ids in _canon from being reused
        self.inputs: list[Input] = []
        self.outputs: list[Value] = []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        metas = [input_meta[pos] if pos < len(input_meta) else node.meta["val"]
                 for pos, node in enumerate(placeholders)]  # fmt: skip
        # A size the region is given (a view's, an expand's: Dynamo's symbol, or a value it has fixed) has
        # no buffer; kernels for fixed sizes read it, like every size, from the graph's shapes (reading a
        # symbol as a number is Dynamo's guard on it). Checked before any size is read: a refusal then
        # leaves no guard behind.
        for node, meta in zip(placeholders, metas, strict=True):
            if isinstance(meta, torch.SymInt) and not all(reads_only_as_size(u, node) for u in node.users):
                raise Unsupported(f"input {node.name}, a size, is read as a number (an index, a bound)")
        for pos, (node, meta) in enumerate(zip(placeholders, metas, strict=True)):
            if isinstance(meta, torch.SymInt) or (size_inputs and isinstance(meta, int) and not isinstance(meta, bool)):
                self.size_inputs.append(pos)
                continue
            if not isinstance(meta, torch.Tensor):
                raise Unsupported(f"input {node.name} is not a tensor")
            compute_type(meta.dtype)
            inp = Input(pos, tuple(fixed(s) for s in meta.shape), tuple(fixed(s) for s in meta.stride()), meta.dtype)
            self.inputs.append(inp)
            self.env[node] = inp
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self.env[node] = self.intern(self._lower(node))
            elif node.op == "output":
                outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
                for out in outs:
                    if not isinstance(out, fx.Node):
                        raise Unsupported("an output is not a tensor")
                    self.outputs.append(self.env[out])
            elif node.op != "placeholder":
                raise Unsupported(f"node kind {node.op} in a region")

    # -- structural sharing -----------------------------------------------------------------------
    def intern(self, v: Value) -> Value:
        """The one value structurally equal to ``v``: equal reductions (softmax and log_softmax of one
        input both take its row max and sum of exponentials) become one object, so the scheduler
        computes them once and the kernel builder's memo shares their pointwise inputs."""
        if id(v) in self._canon:
            return self._canon[id(v)]
        self._alive.append(v)
        out = v
        if isinstance(v, Op):
            args = tuple(self.intern(a) for a in v.args)
            if any(a is not b for a, b in zip(args, v.args, strict=True)):
                out = dataclasses.replace(v, args=args)
        elif isinstance(v, (Reduce, View)):
            src = self.intern(v.src)
            if src is not v.src:
                out = dataclasses.replace(v, src=src)
        elif isinstance(v, Select):
            parts = tuple(self.intern(p) for p in v.parts)
            if any(a is not b for a, b in zip(parts, v.parts, strict=True)):
                out = dataclasses.replace(v, parts=parts)
        key = _structure(out)
        if key is not None:
            out = self._by_key.setdefault(key, out)
        self._alive.append(out)
        self._canon[id(v)] = self._canon[id(out)] = out
        return out

    # -- operands -------------------------------------------------------------------------------
    def _v(self, a: Any, like: torch.dtype = torch.float32) -> Value:
        if isinstance(a, fx.Node):
            if a not in self.env:
                raise Unsupported(f"{a.name}, a size, is used as a value")
            return self.env[a]
        if isinstance(a, bool):
            return Const(a, (), torch.bool)
        if isinstance(a, int):
            return Const(a, (), torch.int64)
        if isinstance(a, float):
            return Const(a, (), torch.float32)
        raise Unsupported(f"operand {a!r} is not a tensor or a number")

    def _op(self, node: fx.Node, op: str, args: Sequence[Any], dtype: torch.dtype | None = None) -> Op:
        vals = tuple(a if isinstance(a, Value) else self._v(a) for a in args)
        out_dtype = dtype or _dtype(node)
        check_integer_op(op, out_dtype)
        if op in COMPARISONS:
            operand = _promote(vals)
        elif op in ("and", "or", "not"):
            operand = "bool"
        elif op == "where":
            operand = compute_type(out_dtype)
        else:
            operand = compute_type(out_dtype)
        return Op(op, vals, _shape(node), out_dtype, operand)

    def _op_on(self, shape: tuple[int, ...], dtype: torch.dtype, op: str, *args: Value) -> Op:
        check_integer_op(op, dtype)
        operand = _promote(args) if op in COMPARISONS else compute_type(dtype)
        return Op(op, tuple(args), shape, dtype, operand)

    # -- one node -------------------------------------------------------------------------------
    def _lower(self, node: fx.Node) -> Value:
        t = node.target
        if t is operator.getitem:
            raise Unsupported("multi-output op (getitem) in a region")
        rule = _RULES.get(t)
        if rule is None:
            raise Unsupported(f"op {op_label(t)} is not pointwise, a view or a supported reduction")
        return rule(self, node, list(node.args), dict(node.kwargs))


def lowers(node: fx.Node) -> bool:
    """The loop IR has a rule for ``node``'s op and computes its output's dtype. The partitioner asks,
    so that a region holds what the code generators can build: one op they cannot lower would send
    the whole region (up to max_nodes nodes) back to unfused ATen calls."""
    if node.target not in _RULES:
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return True
    # What the rules refuse (check_integer_op, _bitwise, _cast_to) is refused here, so that the rest of
    # a region still fuses: a narrow integer result only from an op that moves or picks values
    if val.dtype in NARROW_INTEGERS and node.target not in MOVES_OR_PICKS:
        return False
    if node.target in BITWISE_TARGETS and val.dtype != torch.bool:
        return False
    if node.target in POW_TARGETS and not val.dtype.is_floating_point and not (
            node.target is aten.pow.Tensor_Scalar and node.args[1] in (1, 2, 3)):  # those are products
        return False
    return val.dtype in _COMPUTE


# Ops whose result holds values of their operands (a view, a copy, a choice): exact at any integer width.
MOVES_OR_PICKS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default, aten.permute.default,
    aten.t.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.slice.Tensor, aten.select.int, aten.cat.default, aten.clone.default,
    aten.alias.default, aten.where.self, aten.maximum.default, aten.minimum.default,
})


_PROBE = tuple(sympy.Symbol(f"i{d}", integer=True, nonnegative=True) for d in range(16))


def _structure(v: Value) -> tuple[Any, ...] | None:
    """A hashable description of ``v`` over the identities of its (already interned) operands."""
    if isinstance(v, Const):
        return ("const", repr(v.value), v.shape, v.dtype)
    if isinstance(v, Op):
        return ("op", v.op, tuple(id(a) for a in v.args), v.shape, v.dtype, v.operand_type)
    if isinstance(v, Reduce):
        return ("reduce", v.op, id(v.src), v.dims, v.keepdim, v.scale, v.shape, v.dtype)
    if isinstance(v, Select):
        return ("select", tuple(id(p) for p in v.parts), v.dim, v.offsets, v.shape, v.dtype)
    if isinstance(v, View) and len(v.shape) <= len(_PROBE):
        return ("view", id(v.src), tuple(v.index_map(_PROBE[: len(v.shape)])), v.shape, v.dtype)
    return None  # inputs are distinct by position


def _promote(vals: Sequence[Value]) -> str:
    types = {v.ctype for v in vals}
    for t in ("f32", "i64", "i32", "bool"):
        if t in types:
            return t
    return "f32"


Rule = Callable[[GraphValues, fx.Node, list, dict], Value]
_RULES: dict[Any, Rule] = {}


def _rule(*targets: Any) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for target in targets:
            _RULES[target] = fn
        return fn

    return deco


def _simple(op: str, *targets: Any) -> None:
    def rule(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
        return g._op(node, op, args[: OPS[op].arity])

    for target in targets:
        _RULES[target] = rule


for _name in ("neg", "abs", "exp", "log", "log1p", "expm1", "tanh", "sigmoid", "rsqrt", "sqrt", "erf",
              "reciprocal", "sin", "cos", "floor", "ceil", "trunc", "sign"):
    _simple(_name, getattr(aten, _name).default)
for _name, _packet in (("eq", "eq"), ("ne", "ne"), ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge")):
    _simple(_name, getattr(aten, _packet).Tensor, getattr(aten, _packet).Scalar)
_simple("mul", aten.mul.Tensor, aten.mul.Scalar)
_simple("maximum", aten.maximum.default)
_simple("minimum", aten.minimum.default)
_simple("not", aten.logical_not.default)
_simple("and", aten.logical_and.default)
_simple("or", aten.logical_or.default)


def _bitwise(op: str, *targets: Any) -> None:
    """``~``, ``&``, ``|``: logical on bools, which is all the kernels compute; on integers they act on bits
    (``12 & 10`` is 8, ``~5`` is -6), and are left to ATen (a fuzzer's ``(a & b) | (a + 1)`` gave 2s)."""
    def rule(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
        if _dtype(node) != torch.bool:
            raise Unsupported(f"bitwise {op} on {str(_dtype(node)).replace('torch.', '')} (bits, not truth values)")
        return g._op(node, op, args[: OPS[op].arity])

    for target in targets:
        _RULES[target] = rule


BITWISE_TARGETS = (aten.bitwise_not.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor)
POW_TARGETS = (aten.pow.Tensor_Tensor, aten.pow.Scalar, aten.pow.Tensor_Scalar)
for _name, _target in zip(("not", "and", "or"), BITWISE_TARGETS, strict=True):
    _bitwise(_name, _target)
_simple("where", aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
_simple("pow", aten.pow.Tensor_Tensor, aten.pow.Scalar)


@_rule(torch.ops.accelrun.dropout_uniform.default)
def _uniform(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    # Its one operand is the seed (a 0-dim int64); the kernel builder adds the element's flat index.
    return Op("uniform", (g._v(args[0]),), _shape(node), torch.float32, "i64")


def _one_plus(node: fx.Node, args: list) -> tuple[str, fx.Node] | None:
    """("erf" or "tanh", y) where ``node`` adds 1 to erf(y) or tanh(y) (either order) in float32 and
    nothing else reads that erf or tanh: a GELU's cdf, exact or tanh (its forward and backward as
    decomposed), which ``_cdf`` computes as one expression."""
    if _dtype(node) != torch.float32 or len(args) > 2:
        return None
    for e, c in ((args[0], args[1]), (args[1], args[0])):
        if (isinstance(e, fx.Node) and e.target in (aten.erf.default, aten.tanh.default) and len(e.users) == 1
                and not isinstance(c, bool) and isinstance(c, (int, float)) and c == 1
                and _dtype(e) == torch.float32):
            return ("erf" if e.target is aten.erf.default else "tanh"), e.args[0]
    return None


def _cdf(g: GraphValues, node: fx.Node, kind: str, y: Any) -> Value:
    """1 + erf(y) or 1 + tanh(y) without the sum: ``one_plus_erf`` (erfc(-y), acc_one_plus_erf in C++),
    and 2 / (1 + exp(-2y)) (a sigmoid: one exp and a division where acc_tanh has two pieces). Both
    keep the digits the sum loses where erf or tanh is near -1."""
    if kind == "erf":
        return g._op(node, "one_plus_erf", [y])
    exp = g._op(node, "exp", [g._op(node, "mul", [y, -2.0])])
    return g._op(node, "div", [2.0, g._op(node, "add", [1.0, exp])])


@_rule(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
def _add_sub(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    op = "add" if node.target in (aten.add.Tensor, aten.add.Scalar) else "sub"
    other = g._v(args[1])
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    if op == "add" and alpha == 1 and (plus := _one_plus(node, args)) is not None:
        return _cdf(g, node, *plus)
    if alpha != 1:
        other = g._op_on(other.shape, node.meta["val"].dtype, "mul", other, g._v(alpha))
    return g._op(node, op, [args[0], other])


@_rule(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    x = g._v(args[0])
    alpha = kwargs.get("alpha", 1)
    if alpha != 1:
        x = g._op_on(x.shape, _dtype(node), "mul", x, g._v(alpha))
    return g._op(node, "sub", [args[1], x])


@_rule(aten.div.Tensor, aten.div.Scalar)
def _div(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    if kwargs.get("rounding_mode") is not None:
        raise Unsupported("div with a rounding mode")
    return g._op(node, "div", args[:2])


@_rule(aten.pow.Tensor_Scalar)
def _pow_scalar(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    x, e = g._v(args[0]), args[1]
    shape, dtype = _shape(node), _dtype(node)
    if e == 1:
        return _cast_to(g, x, shape, dtype)
    if e == 2:
        return g._op(node, "mul", [x, x])
    if e == 3:
        return g._op(node, "mul", [g._op(node, "mul", [x, x]), x])
    if e == 0.5:
        return g._op(node, "sqrt", [x])
    if e == -0.5:
        return g._op(node, "rsqrt", [x])
    if e == -1:
        return g._op(node, "reciprocal", [x])
    return g._op(node, "pow", [x, e])


@_rule(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.relu.default)
def _clamp(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    t = node.target
    lo = hi = None
    if t is aten.clamp.default:
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")
    elif t is aten.clamp_min.default:
        lo = args[1]
    elif t is aten.clamp_max.default:
        hi = args[1]
    else:
        lo = 0
    x = g._v(args[0])
    if lo is not None:
        x = g._op(node, "maximum", [x, lo])
    if hi is not None:
        x = g._op(node, "minimum", [x, hi])
    return x


@_rule(aten.silu.default)
def _silu(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    x = g._v(args[0])
    return g._op(node, "mul", [x, g._op(node, "sigmoid", [x])])


@_rule(aten.gelu.default)
def _gelu(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    x = g._v(args[0])
    approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
    if approximate == "tanh":
        # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        x3 = g._op(node, "mul", [g._op(node, "mul", [x, x]), x])
        inner = g._op(node, "mul", [g._op(node, "add", [x, g._op(node, "mul", [x3, 0.044715])]),
                                    math.sqrt(2 / math.pi)])
        return g._op(node, "mul", [g._op(node, "mul", [x, 0.5]), _cdf(g, node, "tanh", inner)])
    return g._op(node, "mul", [g._op(node, "mul", [x, 0.5]), _cdf(g, node, "erf", g._op(node, "mul", [x, 1 / math.sqrt(2)]))])


@_rule(aten.lerp.Scalar, aten.lerp.Tensor)
def _lerp(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    a, b, w = args[0], args[1], args[2]
    return g._op(node, "add", [a, g._op(node, "mul", [w, g._op(node, "sub", [b, a])])])


@_rule(aten.addcmul.default, aten.addcdiv.default)
def _addc(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    x, t1, t2 = args[:3]
    value = kwargs.get("value", args[3] if len(args) > 3 else 1)
    op = "mul" if node.target is aten.addcmul.default else "div"
    term = g._op(node, op, [t1, t2])
    if value != 1:
        term = g._op(node, "mul", [term, value])
    return g._op(node, "add", [x, term])


def _cast_to(g: GraphValues, x: Value, shape: tuple[int, ...], dtype: torch.dtype) -> Value:
    if dtype in NARROW_INTEGERS and x.dtype != dtype:  # (the cast's value would go on unwrapped, as above)
        raise Unsupported(f"a cast to {str(dtype).replace('torch.', '')} (eager wraps it at that width)")
    out: Value = Op("cast", (x,), shape, dtype, x.ctype) if compute_type(dtype) != x.ctype else x
    # Eager rounds at an explicit cast to a narrow float; keep that rounding so results match.
    if dtype in (torch.bfloat16, torch.float16) and x.dtype != dtype:
        out = Op("round_bf16" if dtype == torch.bfloat16 else "round_f16", (out,), shape, dtype, "f32")
    elif out is x:
        out = View(x, lambda idx: idx, shape, dtype)
    return out


@_rule(prims.convert_element_type.default, aten._to_copy.default)
def _convert(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    if kwargs.get("device") is not None and torch.device(kwargs["device"]) != node.meta["val"].device:
        raise Unsupported("a copy across devices")
    return _cast_to(g, g._v(args[0]), _shape(node), _dtype(node))


@_rule(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default)
def _identity(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    return g._v(args[0])


@_rule(aten.scalar_tensor.default, aten.full.default, aten.full_like.default, aten.zeros_like.default,
       aten.ones_like.default)
def _const(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    t = node.target
    if t in (aten.zeros_like.default, aten.ones_like.default):
        value = 0 if t is aten.zeros_like.default else 1
    else:
        value = args[0] if t is aten.scalar_tensor.default else args[1]
    dtype = _dtype(node)
    value = float(value) if dtype.is_floating_point else (bool(value) if dtype == torch.bool else int(value))
    return Const(value, _shape(node), dtype)


# -- views ----------------------------------------------------------------------------------------
def _view(g: GraphValues, node: fx.Node, src: Any, index_map: Callable[[Index], Index]) -> Value:
    return View(g._v(src), index_map, _shape(node), _dtype(node))


@_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _reshape(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    in_shape = _shape(args[0])
    return _view(g, node, args[0], reshape_map(in_shape, _shape(node)))


@_rule(aten.expand.default)
def _expand(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    in_shape, out_shape = _shape(args[0]), _shape(node)
    return _view(g, node, args[0], lambda idx: broadcast_index(idx, out_shape, in_shape))


@_rule(aten.permute.default, aten.t.default, aten.transpose.int)
def _permute(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    ndim = len(_shape(args[0]))
    if node.target is aten.permute.default:
        perm = [d % ndim for d in args[1]]
    else:
        perm = list(range(ndim))
        a, b = (0, 1) if node.target is aten.t.default or ndim < 2 else (args[1] % ndim, args[2] % ndim)
        if ndim >= 2:
            perm[a], perm[b] = perm[b], perm[a]

    def index_map(idx: Index) -> Index:
        res: list[sympy.Expr] = [sympy.Integer(0)] * ndim
        for out_d, in_d in enumerate(perm):
            res[in_d] = idx[out_d]
        return tuple(res)

    return _view(g, node, args[0], index_map)


@_rule(aten.unsqueeze.default)
def _unsqueeze(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    d = args[1] % len(_shape(node))
    return _view(g, node, args[0], lambda idx: idx[:d] + idx[d + 1:])


@_rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    in_shape = _shape(args[0])
    if node.target is aten.squeeze.default:
        dims = {d for d, s in enumerate(in_shape) if s == 1}
    else:
        raw = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        dims = {d % max(len(in_shape), 1) for d in raw if in_shape and in_shape[d % len(in_shape)] == 1}

    def index_map(idx: Index) -> Index:
        it = iter(idx)
        return tuple(sympy.Integer(0) if d in dims else next(it) for d in range(len(in_shape)))

    return _view(g, node, args[0], index_map)


@_rule(aten.slice.Tensor)
def _slice(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    in_shape = _shape(args[0])
    dim = (args[1] if len(args) > 1 else 0) % len(in_shape)
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    step = args[4] if len(args) > 4 else 1
    start = max(0, start + in_shape[dim] if start < 0 else min(start, in_shape[dim]))
    return _view(g, node, args[0], lambda idx: idx[:dim] + (start + idx[dim] * step,) + idx[dim + 1:])


@_rule(aten.select.int)
def _select(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    in_shape = _shape(args[0])
    dim = args[1] % len(in_shape)
    i = args[2] % in_shape[dim]
    return _view(g, node, args[0], lambda idx: idx[:dim] + (sympy.Integer(i),) + idx[dim:])


@_rule(aten.cat.default)
def _cat(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    shape = _shape(node)
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(shape)
    parts = [p for p in args[0] if _shape(p)[dim] > 0 or len(_shape(p)) == len(shape)]
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + _shape(p)[dim])
    return Select(tuple(g._v(p) for p in parts), dim, tuple(offsets), shape, _dtype(node))


# -- reductions -----------------------------------------------------------------------------------
def _make_reduce(op: str, src: Value, dims: tuple[int, ...], keepdim: bool, dtype: torch.dtype,
                 mean: bool = False) -> Reduce:
    count = math.prod(src.shape[d] for d in dims) if dims else 1
    shape = _reduced_shape(src.shape, dims, keepdim)
    return Reduce(op, src, dims, keepdim, 1.0 / count if mean and count else None, shape, dtype)


@_rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
       aten.amin.default, aten.max.default, aten.min.default)
def _reduction(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    t = node.target
    src = g._v(args[0])
    op = {aten.amax.default: "max", aten.max.default: "max", aten.amin.default: "min",
          aten.min.default: "min"}.get(t, "sum")
    has_dims = t in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default)
    dims = _norm_dims(args[1] if has_dims and len(args) > 1 else kwargs.get("dim"), len(src.shape))
    keepdim = bool(args[2] if has_dims and len(args) > 2 else kwargs.get("keepdim", False))
    red = _make_reduce(op, src, dims, keepdim, _dtype(node), mean=t in (aten.mean.dim, aten.mean.default))
    if is_short_middle_reduction(src.shape, dims):
        return _unrolled(g, red)
    if red.shape != _shape(node):
        raise Unsupported(f"reduction result shape {red.shape} differs from the graph's {_shape(node)}")
    return red


# A reduction over middle axes this short becomes pointwise ops on that many slices (GQA's backward
# sums 2-8 query heads per key head: a kernel of its own would be a pass over memory for a few adds).
MAX_UNROLLED_REDUCTION = 8
_COMBINE = {"sum": "add", "max": "maximum", "min": "minimum"}


def is_short_middle_reduction(shape: Sequence[Any], dims: tuple[int, ...]) -> bool:
    """Folds middle axes (neither leading nor trailing) of at most ``MAX_UNROLLED_REDUCTION``
    elements in all: unrolled into pointwise ops, so for the partitioner a gather, not a loop."""
    k, n = len(dims), len(shape)
    middle = bool(dims) and dims != tuple(range(k)) and dims != tuple(range(n - k, n))
    sizes = [shape[d] for d in dims]
    return middle and all(isinstance(s, int) for s in sizes) and math.prod(sizes) <= MAX_UNROLLED_REDUCTION


def _unrolled(g: GraphValues, red: Reduce) -> Value:
    """``red`` as a chain of pointwise ops over the slices of its source, in index order (as ATen
    accumulates), in fp32 with one rounding at the end (as ATen's reductions do)."""
    src, dims, ndim = red.src, red.dims, len(red.src.shape)
    acc_dtype = torch.float32 if red.dtype.is_floating_point else red.dtype

    def slice_at(point: tuple[int, ...]) -> Value:
        fixed = dict(zip(dims, point, strict=True))

        def index_map(idx: Index) -> Index:
            outer = [i for d, i in enumerate(idx) if d not in dims] if red.keepdim else list(idx)
            it = iter(outer)
            return tuple(sympy.Integer(fixed[d]) if d in fixed else next(it) for d in range(ndim))

        return View(src, index_map, red.shape, src.dtype)

    acc: Value | None = None
    for point in itertools.product(*(range(src.shape[d]) for d in dims)):
        part = slice_at(point)
        acc = part if acc is None else g._op_on(red.shape, acc_dtype, _COMBINE[red.op], acc, part)
    assert acc is not None  # dims is not empty
    if red.scale is not None:
        acc = g._op_on(red.shape, acc_dtype, "mul", acc, Const(red.scale, (), torch.float32))
    return _cast_to(g, acc, red.shape, red.dtype)


@_rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(g: GraphValues, node: fx.Node, args: list, kwargs: dict) -> Value:
    x = g._v(args[0])
    shape, dtype = x.shape, _dtype(node)
    dims = _norm_dims(args[1], len(shape))
    row_max = _make_reduce("max", x, dims, True, torch.float32)
    shifted = g._op_on(shape, torch.float32, "sub", x, row_max)
    e = g._op_on(shape, torch.float32, "exp", shifted)
    total = _make_reduce("sum", e, dims, True, torch.float32)
    if node.target is aten._softmax.default:
        return g._op_on(shape, dtype, "div", e, total)
    return g._op_on(shape, dtype, "sub", shifted, g._op_on(total.shape, torch.float32, "log", total))

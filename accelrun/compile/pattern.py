"""Spelling-independent pattern matching on pre-grad (Dynamo) FX graphs.

Dynamo records a multiplication as ``operator.mul``, ``torch.mul`` or ``call_method "mul"`` depending on
how the model spelled it; a pattern here names the canonical op ("mul") and its parameters by name, so
one pattern matches every spelling. Matching is anchored: it starts at a candidate output node and walks
its inputs backwards, backtracking over commutative operands and alternatives.

    x = Tensor("x")
    pattern = Op("mul", x, Op("sigmoid", x))          # also matches sigmoid(x) * x, torch.mul(...)
    for m in iter_matches(pattern, anchor): ...       # m["x"] is the bound node

A match is only accepted when it can be cut out: every interior node's users are inside the match
(only the anchor's value escapes), and no op between the first matched node and the anchor mutates
anything (the replacement runs at the anchor's position, so it must read the same values).
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

# --- canonical ops -------------------------------------------------------------------------------

_REQUIRED = object()  # a parameter without a default
FREE = object()  # a parameter whose value a pattern does not care about unless it names it


@dataclass(frozen=True)
class Param:
    name: str
    default: Any = _REQUIRED
    aliases: tuple[str, ...] = ()  # keyword spellings other than `name` (torch.pow(x, exponent=2))
    varargs: bool = False  # collects the remaining positional arguments (view(x, 2, 3))


def _p(*specs: str | tuple) -> tuple[Param, ...]:
    return tuple(Param(s) if isinstance(s, str) else Param(*s) for s in specs)


_BINARY = _p("input", ("other", _REQUIRED, ("exponent",)))
_UNARY = _p("input")

# Parameter lists in positional order, shared by the function and method spellings (self = input).
SIGNATURES: dict[str, tuple[Param, ...]] = {
    "mul": _BINARY, "matmul": _BINARY, "pow": _BINARY, "eq": _BINARY,
    "add": _BINARY + _p(("alpha", 1)), "sub": _BINARY + _p(("alpha", 1)),
    "div": _BINARY + _p(("rounding_mode", None)),
    "rsqrt": _UNARY, "sqrt": _UNARY, "neg": _UNARY, "sigmoid": _UNARY, "square": _UNARY, "exp": _UNARY,
    "float": _UNARY, "t": _UNARY, "attr.T": _UNARY, "attr.mT": _UNARY, "logical_not": _UNARY,
    "silu": _p("input", ("inplace", False)),
    "mean": _p("input", ("dim", None), ("keepdim", False), ("dtype", None)),
    "softmax": _p("input", ("dim", None), ("dtype", None)),
    "linear": _p("input", "weight", ("bias", None)),
    "cross_entropy": _p(
        "input", "target", ("weight", None), ("size_average", None), ("ignore_index", -100),
        ("reduce", None), ("reduction", "mean"), ("label_smoothing", 0.0),
    ),
    "transpose": _p("input", "dim0", "dim1"),
    "masked_fill": _p("input", "mask", "value"),
    "where": _p("condition", "input", "other"),
    "stack": _p("tensors", ("dim", 0)),
    "unbind": _p("input", ("dim", 0)),
    "getitem": _p("input", "index"),
    "flatten": _p("input", ("start_dim", 0), ("end_dim", -1)),
    "unflatten": _p("input", "dim", "sizes"),
    "view": _p("input", ("shape", (), (), True)), "reshape": _p("input", ("shape", (), (), True)),
    "type_as": _p("input", "other"),
    "to": _p("input", "dtype", ("non_blocking", False), ("copy", False)),
    "dropout": _p("input", ("p", 0.5), ("training", True), ("inplace", False)),
}  # fmt: skip

# Spellings whose positional order differs from the canonical one.
_SIGNATURE_OVERRIDES: dict[Any, tuple[Param, ...]] = {
    F.softmax: _p("input", ("dim", None), ("_stacklevel", FREE), ("dtype", None)),
}

_FUNCTIONS: dict[Any, str] = {}
for _name, _fns in {
    "mul": [operator.mul, torch.mul, torch.multiply, torch.Tensor.mul],
    "add": [operator.add, torch.add, torch.Tensor.add],
    "sub": [operator.sub, torch.sub, torch.subtract, torch.Tensor.sub],
    "div": [operator.truediv, torch.div, torch.divide, torch.true_divide, torch.Tensor.div],
    "matmul": [operator.matmul, torch.matmul, torch.Tensor.matmul],
    "pow": [operator.pow, torch.pow, torch.Tensor.pow],
    "eq": [operator.eq, torch.eq, torch.Tensor.eq],
    "rsqrt": [torch.rsqrt, torch.Tensor.rsqrt],
    "sqrt": [torch.sqrt, torch.Tensor.sqrt],
    "neg": [operator.neg, torch.neg, torch.Tensor.neg],
    "sigmoid": [torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid],
    "square": [torch.square, torch.Tensor.square],
    "exp": [torch.exp, torch.Tensor.exp],
    "t": [torch.t, torch.Tensor.t],
    "logical_not": [torch.logical_not, torch.Tensor.logical_not, operator.invert],
    "silu": [F.silu, torch._C._nn.silu],
    "mean": [torch.mean, torch.Tensor.mean],
    "softmax": [F.softmax, torch.softmax, torch.Tensor.softmax],
    "linear": [F.linear],
    "cross_entropy": [F.cross_entropy],
    "transpose": [torch.transpose, torch.swapaxes, torch.Tensor.transpose],
    "masked_fill": [torch.masked_fill, torch.Tensor.masked_fill],
    "where": [torch.where],
    "stack": [torch.stack],
    "unbind": [torch.unbind, torch.Tensor.unbind],
    "getitem": [operator.getitem],
    "flatten": [torch.flatten, torch.Tensor.flatten],
    "unflatten": [torch.unflatten, torch.Tensor.unflatten],
    "reshape": [torch.reshape, torch.Tensor.reshape],
    "view": [torch.Tensor.view],
    "type_as": [torch.Tensor.type_as],
    "dropout": [F.dropout],
}.items():
    for _fn in _fns:
        _FUNCTIONS[_fn] = _name

# call_method targets: the method name, except where the method's arguments differ from the function's
# (Tensor.where(condition, other) has self in the middle), which are left unrecognised.
_METHODS = {name for name in SIGNATURES if not name.startswith("attr.")} - {"where", "linear", "cross_entropy",
                                                                          "silu", "stack", "getitem", "dropout"}
_ATTRIBUTES = {"T": "attr.T", "mT": "attr.mT"}


def canonical_op(node: Any) -> str | None:
    """The canonical name of what ``node`` computes ("mul", "softmax", ...), or None if unknown."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return node.target if node.target in _METHODS else None
    if node.op != "call_function":
        return None
    if node.target is builtins.getattr and len(node.args) == 2:
        return _ATTRIBUTES.get(node.args[1])
    try:
        return _FUNCTIONS.get(node.target)
    except TypeError:  # an unhashable target
        return None


def normalized_args(node: fx.Node) -> dict[str, Any] | None:
    """The node's arguments by canonical parameter name, defaults filled in; None if they don't fit."""
    op = canonical_op(node)
    if op is None:
        return None
    params = _SIGNATURE_OVERRIDES.get(node.target, SIGNATURES[op]) if node.op == "call_function" else SIGNATURES[op]
    args = list(node.args[:1]) if op.startswith("attr.") else list(node.args)
    kwargs = dict(node.kwargs)
    out: dict[str, Any] = {}
    for param in params:
        if param.varargs:
            rest = args
            args = []
            out[param.name] = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else tuple(rest)
            continue
        keys = [k for k in (param.name, *param.aliases) if k in kwargs]
        if args:
            if keys:
                return None
            out[param.name] = args.pop(0)
        elif keys:
            out[param.name] = kwargs.pop(keys[0])
        elif param.default is _REQUIRED:
            return None
        else:
            out[param.name] = param.default
    if args or kwargs:  # more than the signature knows (an out= argument, an unusual overload)
        return None
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _same(a: Any, b: Any) -> bool:
    """Identity for nodes; value equality for literals (2 == 2.0, [1] == (1,), but True != 1)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if _is_number(a) and _is_number(b):
        return a == b
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


# --- patterns ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _State:
    bindings: tuple[tuple[str, Any], ...] = ()
    nodes: frozenset[fx.Node] = frozenset()  # consumed by Op patterns: the interior, anchor included
    inputs: frozenset[fx.Node] = frozenset()  # bound by Var patterns: values the replacement reads

    def get(self, name: str, default: Any = None) -> Any:
        for k, v in self.bindings:
            if k == name:
                return v
        return default

    def bind(self, name: str, value: Any) -> _State | None:
        for k, v in self.bindings:
            if k == name:
                return self if _same(v, value) else None
        return _State((*self.bindings, (name, value)), self.nodes, self.inputs)

    def add_node(self, node: fx.Node) -> _State:
        return _State(self.bindings, self.nodes | {node}, self.inputs)

    def add_input(self, value: Any) -> _State:
        if not isinstance(value, fx.Node):
            return self
        return _State(self.bindings, self.nodes, self.inputs | {value})


class Pattern:
    def match(self, value: Any, state: _State) -> Iterator[_State]:
        raise NotImplementedError


def as_pattern(x: Any) -> Pattern:
    if isinstance(x, Pattern):
        return x
    if isinstance(x, (list, tuple)):
        return Seq(*x)
    return Lit(x)


class Var(Pattern):
    """Anything (a node or a literal); binds ``name``, and every use of the name must be the same value."""

    def __init__(self, name: str, check: Callable[[Any], bool] | None = None) -> None:
        self.name, self.check = name, check

    def match(self, value, state):
        if self.check is not None and not self.check(value):
            return
        new = state.bind(self.name, value)
        if new is not None:
            yield new.add_input(value)


def Tensor(name: str) -> Var:  # noqa: N802 (reads as a type in patterns)
    """A graph value (a node), never a literal."""
    return Var(name, lambda v: isinstance(v, fx.Node))


def Num(name: str) -> Var:  # noqa: N802
    """A Python int or float literal."""
    return Var(name, _is_number)


class Lit(Pattern):
    """A literal equal to one of ``values`` (2 matches 2.0; lists match tuples)."""

    def __init__(self, *values: Any) -> None:
        self.values = values

    def match(self, value, state):
        if any(_same(value, v) for v in self.values):
            yield state


class Seq(Pattern):
    """A list or tuple argument (torch.stack's tensors), element by element."""

    def __init__(self, *items: Any) -> None:
        self.items = [as_pattern(i) for i in items]

    def match(self, value, state):
        if not isinstance(value, (list, tuple)) or len(value) != len(self.items):
            return
        yield from self._from(0, value, state)

    def _from(self, i, value, state):
        if i == len(self.items):
            yield state
            return
        for s in self.items[i].match(value[i], state):
            yield from self._from(i + 1, value, s)


class OneOf(Pattern):
    """The first alternative that matches (then the next, on backtracking)."""

    def __init__(self, *alternatives: Any) -> None:
        self.alternatives = [as_pattern(a) for a in alternatives]

    def match(self, value, state):
        for alt in self.alternatives:
            yield from alt.match(value, state)


_COMMUTATIVE = {"mul", "add", "eq"}


class Op(Pattern):
    """A node computing canonical op ``op``; positional patterns follow the op's signature.

    Parameters the pattern does not mention must hold their defaults (so ``add(x, y, alpha=2)`` does not
    match ``Op("add", x, y)``), unless ``free=True``. ``name`` binds the node itself, and a second use of
    the same name checks identity instead of matching again (shared sub-expressions).
    """

    def __init__(self, op: str, *args: Any, name: str | None = None, free: bool = False, **kwargs: Any) -> None:
        if op not in SIGNATURES:
            raise ValueError(f"unknown canonical op {op!r}")
        params = [p.name for p in SIGNATURES[op]]
        if len(args) > len(params):
            raise ValueError(f"{op} takes {len(params)} parameters, pattern gives {len(args)}")
        self.op, self.name, self.free = op, name, free
        self.params = {params[i]: as_pattern(a) for i, a in enumerate(args)}
        for k, v in kwargs.items():
            if k not in params:
                raise ValueError(f"{op} has no parameter {k!r}")
            self.params[k] = as_pattern(v)

    def match(self, value, state):
        if canonical_op(value) != self.op:
            return
        if self.name is not None and state.get(self.name) is not None:
            if state.get(self.name) is value:
                yield state
            return
        args = normalized_args(value)
        if args is None:
            return
        if not self.free:
            params = _SIGNATURE_OVERRIDES.get(value.target, SIGNATURES[self.op])
            for p in params:
                if p.name not in self.params and p.default is not FREE and p.default is not _REQUIRED:
                    if not _same(args[p.name], p.default):
                        return
        base = state.add_node(value)
        if self.name is not None:
            base = base.bind(self.name, value)
        orders = [args]
        if self.op in _COMMUTATIVE:
            orders.append({**args, "input": args["other"], "other": args["input"]})
        for a in orders:
            yield from self._params(list(self.params.items()), a, base)

    def _params(self, items, args, state):
        if not items:
            yield state
            return
        (pname, pat), rest = items[0], items[1:]
        for s in pat.match(args[pname], state):
            yield from self._params(rest, args, s)


def Maybe(op: str, inner: Any, **kwargs: Any) -> OneOf:  # noqa: N802
    """``op(inner)`` or just ``inner``: an optional unary op such as a ``.float()`` cast."""
    return OneOf(Op(op, inner, **kwargs), inner)


class Chain(Pattern):
    """Zero or more of the unary ``ops`` (their other arguments free) wrapped around ``inner``."""

    def __init__(self, ops: tuple[str, ...], inner: Any) -> None:
        self.ops, self.inner = ops, as_pattern(inner)

    def match(self, value, state):
        yield from self.inner.match(value, state)
        op = canonical_op(value)
        if op in self.ops:
            args = normalized_args(value)
            if args is not None:
                yield from self.match(args["input"], state.add_node(value))


# --- matches -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Match:
    anchor: fx.Node
    nodes: frozenset[fx.Node]  # every node the pattern consumed, anchor included
    bindings: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.bindings.get(name, default)


def iter_matches(pattern: Pattern, anchor: fx.Node) -> Iterator[Match]:
    """Every way ``pattern`` matches at ``anchor`` whose interior can be cut out of the graph."""
    seen: set[tuple] = set()
    for state in pattern.match(anchor, _State()):
        # Bindings may hold unhashable literals (a list of dims): key them by identity or repr.
        key = (tuple((k, id(v) if isinstance(v, fx.Node) else repr(v)) for k, v in state.bindings), state.nodes)
        if key in seen:
            continue
        seen.add(key)
        # A value both consumed and read (y * y matched as "normed * weight") cannot be cut out.
        if anchor in state.nodes and not state.inputs & state.nodes and _is_self_contained(anchor, state.nodes):
            yield Match(anchor, state.nodes, dict(state.bindings))


def _is_self_contained(anchor: fx.Node, nodes: frozenset[fx.Node]) -> bool:
    for n in nodes:
        if n is not anchor and any(u not in nodes for u in n.users):
            return False
    # Walk back from the anchor over the span the match covers; nothing in it may mutate a value.
    remaining = len(nodes) - 1
    node = anchor.prev
    while remaining and node.op != "root":
        if node in nodes:
            remaining -= 1
        elif is_mutating(node):
            return False
        node = node.prev
    return remaining == 0


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow,
                      operator.imatmul, operator.setitem, operator.iand, operator.ior}


def is_mutating(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_") or "out" in node.kwargs
    return False


# --- rewriting -----------------------------------------------------------------------------------


def example_value(node: Any) -> Any:
    """A tensor (possibly fake) or metadata with ``.shape``/``.dtype`` for ``node``; None if unknown."""
    if not isinstance(node, fx.Node):
        return None
    for key in ("example_value", "val", "tensor_meta"):
        v = node.meta.get(key)
        if v is not None and hasattr(v, "shape") and hasattr(v, "dtype"):
            return v
    return None


def same_size(a: Any, b: Any) -> bool:
    """Sizes provably equal, without adding a guard when either is symbolic (dynamic shapes)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b, strict=True))


def is_scalar(value: Any) -> bool:
    """A Python number, or a graph value that is one (Dynamo's ``.item()`` of a float attribute when
    compiling with dynamic=True)."""
    if _is_number(value):
        return True
    if not isinstance(value, fx.Node):
        return False
    v = value.meta.get("example_value", value.meta.get("val"))
    return isinstance(v, (torch.SymFloat, torch.SymInt, float, int)) and not isinstance(v, bool)


def static_shape(node: Any) -> tuple[int, ...] | None:
    v = example_value(node)
    if v is None or not all(isinstance(s, int) for s in v.shape):
        return None
    return tuple(v.shape)


def shape_but_length(node: Any, dims: int, axis: int) -> tuple[Any, ...] | None:
    """The sizes of a ``dims``-d value whose size on ``axis`` alone may be a symbol (Dynamo's, for a
    sequence length that changes between calls); None for any other value."""
    v = example_value(node)
    if not isinstance(v, torch.Tensor) or v.dim() != dims:
        return None
    if not all(isinstance(n, int) for i, n in enumerate(v.shape) if i != axis % dims):
        return None
    return tuple(v.shape)


# Functions and methods a value computed from numbers alone may go through (positions, masks): each
# gives the same result every call and reads nothing but its arguments. Random ones, uninitialised
# memory (empty) and in-place ones are left out.
FOLDABLE = frozenset({
    "arange", "add", "sub", "mul", "neg", "getitem", "new_ones", "new_zeros", "ones", "zeros", "full", "ones_like",
    "zeros_like", "unsqueeze", "expand", "view", "reshape", "le", "lt", "ge", "gt", "eq", "ne", "and_", "or_",
    "xor", "invert", "logical_and", "logical_or", "logical_not", "to", "diff", "cumsum", "tril", "triu", "where",
    "clone", "contiguous", "bool",
})  # fmt: skip


def constant_value(node: fx.Node, max_numel: int) -> torch.Tensor | None:
    """The value of ``node`` when the graph computes it from numbers alone (an arange, comparisons,
    indexing: transformers' causal mask under torch.compile), evaluated now; None when it reads an
    input, a parameter or anything outside ``FOLDABLE``, when a value has more than ``max_numel``
    elements, or when evaluating fails."""
    needed: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", None)
        if n.op not in ("call_function", "call_method") or name not in FOLDABLE:
            return None
        needed.add(n)
        stack.extend(n.all_input_nodes)
    env: dict[fx.Node, Any] = {}
    try:
        for n in (n for n in node.graph.nodes if n in needed):  # a graph's nodes are in a topological order
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            out = getattr(args[0], n.target)(*args[1:], **kwargs) if n.op == "call_method" else n.target(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.numel() > max_numel:
                return None
            env[n] = out
    except Exception:  # noqa: BLE001 (a symbolic size, a device not here: not a constant after all)
        return None
    value = env[node]
    return value if isinstance(value, torch.Tensor) else None


def replace_match(gm: fx.GraphModule, match: Match, new: fx.Node) -> None:
    """Route the anchor's users to ``new`` (inserted before the anchor) and delete the matched nodes."""
    graph = gm.graph
    for key, value in match.anchor.meta.items():
        new.meta.setdefault(key, value)
    match.anchor.replace_all_uses_with(new)
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs: list[fx.Node] = []
    for node in sorted(match.nodes, key=order.__getitem__, reverse=True):
        inputs.extend(i for i in node.all_input_nodes if i not in match.nodes)
        graph.erase_node(node)
    erase_dead(graph, inputs)


def erase_dead(graph: fx.Graph, candidates: list[fx.Node]) -> None:
    """Erase candidates (and their inputs, transitively) that nothing uses any more and are pure."""
    stack = list(candidates)
    while stack:
        node = stack.pop()
        if getattr(node, "_erased", False) or node.users or node.op not in ("call_function", "call_method"):
            continue
        if is_mutating(node) or node.is_impure():
            continue
        stack.extend(node.all_input_nodes)
        graph.erase_node(node)


def rewrite_all(
    gm: fx.GraphModule,
    roots: set[str],
    try_rewrite: Callable[[fx.GraphModule, fx.Node], fx.Node | None],
) -> int:
    """Call ``try_rewrite(gm, node)`` on each node computing one of ``roots``, last node first.

    Going backwards lets the widest match (e.g. RMSNorm with its weight multiply) win over a match
    inside it. ``try_rewrite`` inserts its replacement and calls ``replace_match``; it returns the new
    node, or None when it declines. Returns how many rewrites happened.
    """
    count = 0
    for node in reversed(list(gm.graph.nodes)):
        # A node an earlier rewrite deleted is still in the list taken above: skip it.
        if getattr(node, "_erased", False) or canonical_op(node) not in roots:
            continue
        if try_rewrite(gm, node) is not None:
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def replace_with_call(
    gm: fx.GraphModule, match: Match, target: Callable, args: tuple, kwargs: dict | None = None
) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the anchor, give it the anchor's users, delete the match."""
    with gm.graph.inserting_before(match.anchor):
        new = gm.graph.call_function(target, tuple(args), kwargs or {})
    replace_match(gm, match, new)
    return new


def is_dim(value: Any, ndim: int | None, want: int) -> bool:
    """``value`` (an int, or a one-element list) names dimension ``want`` (negative: from the end)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            return False
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    if value == want:
        return True
    if ndim is None:
        return False
    return value % ndim == want % ndim if -ndim <= value < ndim else False


def float32_cast(x: Any) -> OneOf:
    """``x.float()`` or ``x.to(torch.float32)``."""
    return OneOf(Op("float", x), Op("to", x, dtype=Lit(torch.float32)))

"""Common-subexpression elimination: two calls of the same pure op on the same arguments are one.

The key of a node is its target plus a structural encoding of its args and kwargs in which every
scalar carries its type (``1``, ``1.0`` and ``True`` differ: they promote differently) and floats are
compared by bit pattern (``-0.0`` is not ``0.0``; a NaN equals the same NaN). Nodes are visited in
graph order and a duplicate's users are rewired before they are keyed, so chains of duplicates fold in
one sweep.

Never merged: ops that are not pure (random, mutating, collectives; see ``dce.op_is_pure``), ops
whose result's identity matters (``empty``-like buffers), and any node reading or being a value that
some op in the graph mutates (its value depends on where it sits relative to the mutation).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass
from accelrun.compile.passes.dce import op_is_pure

aten = torch.ops.aten

# Fresh buffers: two of them are two allocations a later op may write into.
_FRESH_BUFFERS = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default,
})  # fmt: skip


class _NoKey(Exception):
    """An argument this pass cannot compare structurally: leave the node alone."""


def _float_key(x: float) -> str:
    # float.hex keeps the sign of zero and spells every NaN "nan", so equal keys mean equal bits
    # (up to NaN payloads, which no ATen op observes).
    return x.hex() if not math.isnan(x) else "nan"


def _arg_key(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return ("node", a)
    if a is None:
        return ("none",)
    if isinstance(a, bool):  # before int: True == 1 in Python
        return ("bool", a)
    if isinstance(a, int):
        return ("int", a)
    if isinstance(a, float):
        return ("float", _float_key(a))
    if isinstance(a, complex):
        return ("complex", _float_key(a.real), _float_key(a.imag))
    if isinstance(a, str):
        return ("str", a)
    if isinstance(a, list):  # also fx's immutable_list
        return ("list", tuple(_arg_key(x) for x in a))
    if isinstance(a, tuple):
        return ("tuple", tuple(_arg_key(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((str(k), _arg_key(v)) for k, v in a.items())))
    if isinstance(a, slice):
        return ("slice", _arg_key(a.start), _arg_key(a.stop), _arg_key(a.step))
    if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(a).__name__, str(a))
    raise _NoKey(type(a).__name__)


def _mutated_values(graph: fx.Graph) -> set[fx.Node]:
    """Nodes passed to an argument that some op's schema declares it writes."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if not target._schema.is_mutable:
            continue
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, fx.Node):
                    out.add(v)
    return out


def _mergeable(node: fx.Node, mutated: set[fx.Node]) -> bool:
    if node.op == "get_attr":
        return node not in mutated
    if node.op != "call_function" or not op_is_pure(node.target) or node.target in _FRESH_BUFFERS:
        return False
    if node in mutated:
        return False
    return not any(inp in mutated for inp in node.all_input_nodes)


def eliminate_common_subexpressions(graph: fx.Graph) -> int:
    """Replace each later duplicate by its first occurrence; returns how many nodes were merged."""
    mutated = _mutated_values(graph)
    seen: dict[Any, fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if not _mergeable(node, mutated):
            continue
        try:
            key = (node.op, node.target, _arg_key(node.args), _arg_key(dict(node.kwargs)))
            hash(key)
        except (_NoKey, TypeError):
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        merged += 1
    return merged


@register_pass("cse", "post_grad", PassOptions)
def cse(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Merge repeated pure computations of the same op on the same arguments."""
    merged = eliminate_common_subexpressions(gm.graph)
    if merged:
        gm.recompile()
    return PassResult(changed=merged > 0, summary=f"merged {merged} nodes", counts={"merged": merged})

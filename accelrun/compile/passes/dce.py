"""Dead-code elimination on an ATen graph, and the purity test other passes share.

A node is removed when nothing uses it and running it has no effect besides its value. "Pure" is
decided from what the op declares, never guessed: an op is pure only if its schema writes no argument
(``_schema.is_mutable``), it draws no random numbers (``Tag.nondeterministic_seeded``: dropping it
would shift the RNG stream of later ops), it is not a collective or a wait on one, and it is not on
the deny-list below. Python callables are pure only if listed (``getitem``, SymInt arithmetic).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass

aten = torch.ops.aten

# Namespaces whose ops talk to other ranks or order work on streams: never removed or merged.
_EFFECTFUL_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                                   "c10d", "_dtensor", "profiler", "streams"})

# Ops that declare no mutation yet matter for what they do, not what they return.
_DENY = frozenset({
    aten._assert_async.default, aten._assert_async.msg, aten._assert_scalar.default,
    aten.sym_constrain_range.default, aten.sym_constrain_range_for_size.default,
    aten._print.default, aten._functional_assert_async.msg,
})  # fmt: skip

# Python-level callables that appear in ATen graphs and are known to be pure.
_PURE_PYTHON = frozenset({
    operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.eq, operator.ne, operator.lt, operator.le,
    operator.gt, operator.ge, operator.and_, operator.or_, operator.not_, operator.abs,
    math.ceil, math.floor, math.sqrt, math.trunc,
    torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sqrt,
    torch.sym_ite,
})  # fmt: skip


def op_is_pure(target: Any) -> bool:
    """True if calling ``target`` has no effect besides computing its result."""
    if isinstance(target, torch._ops.OpOverload):
        if target in _DENY or target.namespace in _EFFECTFUL_NAMESPACES:
            return False
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
        return not target._schema.is_mutable
    try:
        return target in _PURE_PYTHON
    except TypeError:  # an unhashable callable: unknown, so not pure
        return False


def node_is_pure(node: fx.Node) -> bool:
    """Whether ``node`` may be removed when unused (placeholders and the output never are)."""
    if node.op == "get_attr":
        return True
    if node.op != "call_function":
        return False  # call_module / call_method: unknown code
    return op_is_pure(node.target)


def eliminate_dead_code(graph: fx.Graph) -> int:
    """Remove unused pure nodes; returns how many. Walks backwards so whole dead chains go in one sweep."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "output") or node.users:
            continue
        if node_is_pure(node):
            graph.erase_node(node)
            removed += 1
    return removed


@register_pass("dce", "post_grad", PassOptions)
def dce(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Remove nodes nobody uses whose op has no side effects."""
    removed = eliminate_dead_code(gm.graph)
    if removed:
        gm.recompile()
    return PassResult(changed=removed > 0, summary=f"removed {removed} nodes", counts={"removed": removed})

"""What kind of operation an ATen node is, as the region partitioner and the code generators see it.

- pointwise: one output element from the same-index elements of the inputs (after broadcasting);
  ATen tags these ops (``torch.Tag.pointwise``).
- reduction: folds one or more axes (``torch.Tag.reduction``: sum, amax, mean, …).
- view: reinterprets the layout without computing (view, expand, permute, unsqueeze, …); inside a
  region a code generator turns it into index arithmetic.
- other: everything else (matmuls, attention, random numbers, collectives): never inside a region.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

OpKind = Literal["pointwise", "reduction", "view", "other"]

aten = torch.ops.aten
prims = torch.ops.prims

VIEW_OPS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.squeeze.default, aten.t.default, aten.transpose.int, aten.alias.default, aten.slice.Tensor,
    aten.select.int,
})  # fmt: skip

# Pointwise by tag, but not something a fusion region should hold: random numbers (their state
# lives outside the graph) and ops with side effects.
NOT_FUSIBLE = frozenset({
    aten.bernoulli.default, aten.bernoulli.p, aten.rand_like.default, aten.randn_like.default,
    aten.native_dropout.default,
})  # fmt: skip

# ATen tags _to_copy as neither; a dtype-only _to_copy is a cast, which is pointwise.
_CASTS = frozenset({aten._to_copy.default, prims.convert_element_type.default})


def op_kind(target: Any, kwargs: dict[str, Any] | None = None) -> OpKind:
    if not isinstance(target, torch._ops.OpOverload) or target in NOT_FUSIBLE:
        return "other"
    if target in VIEW_OPS:
        return "view"
    if target in _CASTS:
        # A cast that also moves devices or changes layout is not pointwise.
        kw = kwargs or {}
        if kw.get("device") is not None or kw.get("layout") not in (None, torch.strided):
            return "other"
        return "pointwise"
    tags = target.tags
    if torch.Tag.pointwise in tags:
        return "pointwise"
    if torch.Tag.reduction in tags:
        return "reduction"
    return "other"


def node_kind(node: torch.fx.Node) -> OpKind:
    if node.op != "call_function":
        return "other"
    return op_kind(node.target, dict(node.kwargs))

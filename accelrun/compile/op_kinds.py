"""What kind of operation an ATen node is, as the region partitioner and the code generators see it.

- pointwise: one output element from the same-index elements of the inputs (after broadcasting);
  ATen tags these ops (``torch.Tag.pointwise``).
- reduction: folds one or more axes (``torch.Tag.reduction``: sum, amax, mean, …).
- view: reinterprets the layout without computing (view, expand, permute, unsqueeze, …); inside a
  region a code generator turns it into index arithmetic.
- constant: a tensor filled with one number (``full``, ``zeros_like``, ``scalar_tensor``): inside a
  region it is that number, never written to memory (a gradient's zeros, a mask's fill value).
- other: everything else (matmuls, attention, random numbers, collectives): never inside a region;
  except random numbers drawn as a function of (seed, element index), which are pointwise.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

import accelrun.compile.fused.dropout  # noqa: F401  (registers accelrun::dropout_uniform)

OpKind = Literal["pointwise", "reduction", "view", "constant", "other"]

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

# Random numbers that are a function of (seed, element index) alone (``fused.dropout``): a region's
# generated code draws them in its own loop, as it computes any other pointwise op.
GENERATED_RANDOM = frozenset({torch.ops.accelrun.dropout_uniform.default})

# ATen tags _to_copy as neither; a dtype-only _to_copy is a cast, which is pointwise.
_CASTS = frozenset({aten._to_copy.default, prims.convert_element_type.default})

# Softmax and log-softmax are row reductions followed by a pointwise epilogue, with an output as large
# as their input; ATen tags them as neither.
ROW_SOFTMAX = frozenset({aten._softmax.default, aten._log_softmax.default})

CONSTANTS = frozenset({
    aten.full.default, aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.scalar_tensor.default,
})  # fmt: skip


def op_kind(target: Any, kwargs: dict[str, Any] | None = None) -> OpKind:
    if not isinstance(target, torch._ops.OpOverload) or target in NOT_FUSIBLE:
        return "other"
    if target in VIEW_OPS:
        return "view"
    if target in GENERATED_RANDOM:
        return "pointwise"
    if target in ROW_SOFTMAX:
        return "reduction"
    if target in CONSTANTS:
        kw = kwargs or {}
        # A fill with a symbolic value, or a non-strided or pinned tensor, is left to ATen.
        fill = kw.get("fill_value", 0)
        plain = kw.get("layout") in (None, torch.strided) and not kw.get("pin_memory")
        return "constant" if plain and isinstance(fill, (int, float, bool)) else "other"
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
    kwargs = dict(node.kwargs)
    if node.target in _CASTS and "device" in kwargs and _same_device_as_input(node, kwargs["device"]):
        kwargs.pop("device")  # AOTAutograd spells `x.float()` with the device it already has
    if node.target in CONSTANTS:
        kwargs["fill_value"] = fill_value(node)
    return op_kind(node.target, kwargs)


def _same_device_as_input(node: torch.fx.Node, device: Any) -> bool:
    src = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    return isinstance(src, torch.Tensor) and device is not None and torch.device(device) == src.device


def fill_value(node: torch.fx.Node) -> Any:
    """The number a constant op fills with (positional or keyword)."""
    t = node.target
    if t in (aten.zeros_like.default, aten.ones_like.default):
        return 0 if t is aten.zeros_like.default else 1
    i = 0 if t is aten.scalar_tensor.default else 1
    return node.args[i] if len(node.args) > i else node.kwargs.get("fill_value", node.kwargs.get("s"))

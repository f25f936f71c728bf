"""Rewrite writes into a constant tensor as pointwise ops, which a fusion region can hold.

Autograd's formulas often build a gradient by scattering into zeros: cross-entropy's backward
scatters -1 at each row's target into a zero tensor of the logits' size, a slice's backward
(``rotate_half`` in Hugging Face's RoPE, a ``split``) writes the slice's gradient into zeros of the
input's size. Left as ATen ops, each fills a whole tensor and copies it before the fused region
that reads it; written as below, the region computes every element where it needs it:

- ``scatter(full(c), dim, index, v)`` with one index per row along ``dim`` (its other sizes equal
  the base's) becomes ``where(arange(n) == index, v, c)``: the arange (``n`` integers) stays an
  ATen input, the comparison and the select join the region.
- ``slice_scatter(full(c), src, dim, start, end)`` (step 1) becomes ``cat([full(c), src, full(c)],
  dim)``: a region computes each element of a cat from the part it falls in, constants as numbers.

For these two, only a base that is a constant (``op_kinds``: ``full``, ``zeros_like``, …) is
rewritten; the result has the same values, dtype and shape. A base left without users is removed.

- On a CPU, ``index_put(base, [index], values, accumulate=True)`` with one integer index over the
  first axis (an embedding's backward, into zeros; any base) becomes ``index_add(base, 0, index,
  values)`` on the flattened index, negative indices wrapped first as ``index_put`` does: the same
  sums, and ATen's CPU ``index_add`` adds rows several times faster. Not on CUDA, where
  ``index_add`` adds with atomics and the sums would change from run to run.

- ``constant_pad_nd(x, pad, c)`` of a contiguous ``x`` with pads of zero or more becomes
  ``cat([full(c), x, full(c)])`` along each padded dim (the shifted labels of a causal-LM loss:
  ``pad(labels, (0, 1), -100)``).

- ``add(a, index_put(zeros, [index], values, accumulate=True))`` (either order; or the ``index_add`` the
  rule above makes) becomes ``index_put(a, [index], values, accumulate=True)``: the same sums without
  filling and reading a whole tensor of zeros. Autograd adds up the gradients of a tensor that
  several ``x[rows]`` read so (a mixture's experts: one whole-size tensor of zeros per expert);
  ``reinplace`` then writes each into the one before it.

Also: a ``cat`` drops its empty parts (transformers' key/value cache starts as an empty tensor that
each forward concatenates onto), and a cat left with one part becomes a ``clone`` of it, which a
region computes where the part is computed instead of copying it.
"""

from __future__ import annotations

import torch
from torch import fx

from accelrun.compile.op_kinds import fill_value, node_kind
from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass
from accelrun.compile.passes.dce import op_is_pure
from accelrun.compile.passes.graph_build import NodeBuilder, tensor_val
from accelrun.compile.pattern import same_shape

aten = torch.ops.aten


def _constant(build: NodeBuilder, before: fx.Node, like: torch.Tensor, shape: list[int], value) -> fx.Node:
    return build(before, aten.full.default, shape, value, dtype=like.dtype, layout=torch.strided,
                 device=like.device, pin_memory=False)  # fmt: skip


def _static(*vals: torch.Tensor | None) -> bool:
    """Every size known as an int: comparing a data-dependent (unbacked) size would make Dynamo guard
    on it, which it cannot do (an MoE's tokens per expert)."""
    return all(v is not None and all(isinstance(s, int) for s in v.shape) for v in vals)


def _read_from_data(val: torch.Tensor) -> bool:
    """Whether a size of ``val`` is a value read from the data (unbacked): no guard can hold it."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(val.shape))


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _scatter_to_where(build: NodeBuilder, node: fx.Node) -> fx.Node | None:
    base, dim, index, value = (_arg(node, i, name) for i, name in enumerate(("self", "dim", "index", "value")))
    out, idx = tensor_val(node), tensor_val(index)
    if node_kind(base) != "constant" or not _static(out, idx) or not isinstance(value, (int, float, bool)):
        return None
    dim %= out.dim()
    other_dims_match = all(idx.shape[d] == out.shape[d] for d in range(out.dim()) if d != dim)
    if idx.dim() != out.dim() or idx.shape[dim] != 1 or not other_dims_match:
        return None
    positions = build(node, aten.arange.default, out.shape[dim], dtype=idx.dtype, layout=torch.strided,
                      device=out.device, pin_memory=False)  # fmt: skip
    along = [1] * out.dim()
    along[dim] = out.shape[dim]
    hit = build(node, aten.eq.Tensor, build(node, aten.view.default, positions, along), index)
    scattered = build(node, aten.scalar_tensor.default, value, dtype=out.dtype, layout=torch.strided,
                      device=out.device, pin_memory=False)  # fmt: skip
    return build(node, aten.where.self, hit, scattered, base)


def _slice_scatter_to_cat(build: NodeBuilder, node: fx.Node) -> fx.Node | None:
    base, src = node.args[:2]
    dim, start, end, step = (_arg(node, i, name, d) for i, name, d in
                             ((2, "dim", 0), (3, "start", None), (4, "end", None), (5, "step", 1)))
    out = tensor_val(node)
    bounds_known = all(isinstance(b, int) for b in (start or 0, end or 0, step))
    if node_kind(base) != "constant" or not _static(out) or not bounds_known or step != 1:
        return None
    dim %= out.dim()
    n = out.shape[dim]
    start = 0 if start is None else min(max(start + n if start < 0 else start, 0), n)
    end = n if end is None else min(max(end + n if end < 0 else end, start), n)
    return _between_constants(build, node, src, list(out.shape), dim, start, n - end, fill_value(base))


def _between_constants(build: NodeBuilder, before: fx.Node, middle: fx.Node, shape: list[int], dim: int,
                       lead: int, trail: int, value) -> fx.Node:  # fmt: skip
    """``cat([full(value), middle, full(value)], dim)`` with ``lead`` and ``trail`` entries of ``value``
    along ``dim`` (a side of none is left out); ``shape`` gives the constants' other sizes."""
    like = tensor_val(before)

    def side(n: int) -> list[fx.Node]:
        sizes = list(shape)
        sizes[dim] = n
        return [_constant(build, before, like, sizes, value)] if n else []

    return build(before, aten.cat.default, [*side(lead), middle, *side(trail)], dim)


def _cat_without_empty_parts(build: NodeBuilder, node: fx.Node) -> fx.Node | None:
    parts, dim = node.args[0], _arg(node, 1, "dim", 0)
    out = tensor_val(node)
    vals = [tensor_val(p) for p in parts]
    if not _static(out, *vals):
        return None
    kept = [p for p, v in zip(parts, vals, strict=True) if v.numel() != 0 or v.dim() == out.dim() and out.numel() == 0]
    if len(kept) == len(parts) or not kept or any(tensor_val(p).dtype != out.dtype for p in kept):
        return None
    if len(kept) == 1:  # a copy in the layout the cat gave (contiguous), or none of this
        if not out.is_contiguous():
            return None
        return build(node, aten.clone.default, kept[0], memory_format=torch.contiguous_format)
    return build(node, aten.cat.default, kept, dim)


def _pad_to_cat(build: NodeBuilder, node: fx.Node) -> fx.Node | None:
    x, pad = node.args[0], node.args[1]
    value = _arg(node, 2, "value", 0)
    out, val = tensor_val(node), tensor_val(x)
    if not _static(out, val) or not isinstance(value, (int, float, bool)) or val.numel() == 0:
        return None
    if not (val.is_contiguous() and out.is_contiguous()):
        return None  # the pad keeps a channels-last input's layout; a cat would make it contiguous
    if not all(isinstance(p, int) and p >= 0 for p in pad) or len(pad) > 2 * val.dim():
        return None  # a negative pad crops: left to ATen
    if not val.dtype.is_floating_point and value != int(value):
        return None
    value = value if val.dtype.is_floating_point else int(value)
    padded, shape = x, list(val.shape)
    for k in range(len(pad) // 2):  # pad lists (before, after) pairs from the last dim backwards
        dim, before, after = val.dim() - 1 - k, pad[2 * k], pad[2 * k + 1]
        if before == after == 0:
            continue
        padded = _between_constants(build, node, padded, shape, dim, before, after, value)
        shape[dim] += before + after
    return padded if padded is not x else None


def _accumulate_as_index_add(build: NodeBuilder, node: fx.Node) -> fx.Node | None:
    base, indices, values = node.args[:3]
    if not _arg(node, 3, "accumulate", False) or not isinstance(indices, (list, tuple)) or len(indices) != 1:
        return None
    index = indices[0]
    out, vals, idx = tensor_val(node), tensor_val(values), tensor_val(index)
    if out is None or vals is None or idx is None or not _static(out):
        return None
    # CPU only: there ATen's index_add is the faster sum; on CUDA it adds with atomics, so repeated
    # indices would sum in a different order from run to run where index_put's order is fixed.
    if out.device.type != "cpu" or idx.device != out.device:
        return None
    if idx.dtype not in (torch.int64, torch.int32) or vals.dtype != out.dtype:
        return None
    if not same_shape(vals.shape, (*idx.shape, *out.shape[1:])):  # no broadcast of the values
        return None
    if _static(vals, idx):
        flat = build(node, aten.reshape.default, index, [idx.numel()])
        rows = build(node, aten.reshape.default, values, [idx.numel(), *out.shape[1:]])
    elif idx.dim() == 1:  # one index per row already (rows a mask or a router picked: read from the data)
        flat, rows = index, values
    elif not _read_from_data(idx):  # a graph for any length: its index is [batch, length]; -1 holds for both
        flat = build(node, aten.reshape.default, index, [-1])
        rows = build(node, aten.reshape.default, values, [-1, *out.shape[1:]])
    else:
        return None  # no reshape of a size the graph does not hold
    negative = build(node, aten.lt.Scalar, flat, 0)
    wrapped = build(node, aten.where.self, negative, build(node, aten.add.Tensor, flat, out.shape[0]), flat)
    return build(node, aten.index_add.default, base, 0, wrapped, rows)


def _scattered_into_zeros(node: fx.Node, out: torch.Tensor) -> bool:
    """``node`` adds values into a tensor of zeros shaped like ``out``, and only one op reads it."""
    if node.op != "call_function" or len(node.users) != 1 or not node.args:
        return False
    if node.target is aten.index_put.default:
        indices = node.args[1]
        if not (_arg(node, 3, "accumulate", False) and isinstance(indices, (list, tuple)) and len(indices) == 1):
            return False
    elif node.target is not aten.index_add.default or _arg(node, 4, "alpha", 1) != 1:
        return False
    zeros, val = node.args[0], tensor_val(node)
    if not (isinstance(zeros, fx.Node) and node_kind(zeros) == "constant" and fill_value(zeros) == 0):
        return False
    return val is not None and _static(val) and val.dtype == out.dtype and _same_dense_layout(val, out)


def _same_dense_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, both contiguous: the write that replaces an ``add`` lays its result out as its
    base (``index_add`` contiguously), where the add took its layout from both operands."""
    return tuple(a.shape) == tuple(b.shape) and a.is_contiguous() and b.is_contiguous()


def _add_of_scattered_zeros(build: NodeBuilder, node: fx.Node) -> fx.Node | None:
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    out = tensor_val(node)
    if out is None or not _static(out):
        return None
    for scattered, other in (node.args, reversed(node.args)):
        other_val = tensor_val(other) if isinstance(other, fx.Node) else None
        if not isinstance(scattered, fx.Node) or not _scattered_into_zeros(scattered, out) or other_val is None:
            continue
        if not _static(other_val) or not _same_dense_layout(other_val, out) or other_val.dtype != out.dtype:
            continue
        return build(node, scattered.target, other, *scattered.args[1:], **scattered.kwargs)
    return None


# ATen op → (the name its rewrites are counted under, the rewrite); a rewrite returns None to decline.
_REWRITES = {
    aten.scatter.value: ("scatter", _scatter_to_where),
    aten.slice_scatter.default: ("slice_scatter", _slice_scatter_to_cat),
    aten.cat.default: ("empty_cat_parts", _cat_without_empty_parts),
    aten.index_put.default: ("index_put", _accumulate_as_index_add),
    aten.constant_pad_nd.default: ("constant_pad_nd", _pad_to_cat),
    aten.add.Tensor: ("add_of_scattered_zeros", _add_of_scattered_zeros),
}


@register_pass("simplify", "post_grad", PassOptions)
def simplify(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Scatters into constant tensors become pointwise selects and cats, cats drop empty parts (see
    the module's docstring)."""
    build = NodeBuilder(gm)
    counts: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        name, rewrite = _REWRITES.get(node.target, (None, None)) if node.op == "call_function" else (None, None)
        if rewrite is None or build.fake_mode is None or not node.args:
            continue
        new = rewrite(build, node)
        if new is None:
            continue
        inputs = node.all_input_nodes
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        erased: set[fx.Node] = set()
        while inputs:  # a constant base, an empty part, a scatter into zeros that nothing reads any more
            old = inputs.pop()
            if old not in erased and not old.users and old.op == "call_function" and op_is_pure(old.target):
                inputs += old.all_input_nodes
                gm.graph.erase_node(old)
                erased.add(old)
        counts[name] = counts.get(name, 0) + 1
    if counts:
        gm.graph.lint()
        gm.recompile()
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "nothing to rewrite"
    return PassResult(changed=bool(counts), summary=f"rewrote {summary}", counts=counts)

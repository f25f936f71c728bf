"""A log-softmax's backward recomputes it from its input and two per-row statistics.

``log_softmax(x) = (x - m) - log(s)`` with ``m = amax(x)`` and ``s = sum(exp(x - m))`` along the row,
as ATen's decomposition computes it. Kept as it is, the output is saved for the backward: a whole
tensor the forward writes and the backward reads (a language model's fp32 log-probabilities, rows ×
vocabulary), while the input ``x`` is usually kept anyway (the model's logits, one of its outputs).

Rewritten in the joint graph, before it is cut into forward and backward, the forward computes ``m``
and ``log(s)`` (one region, one pass over ``x``) and reads the loss's entries from ``x`` itself
(``gather(x) - m - log(s)``); the backward computes ``(x - m) - log(s)`` where it needs it, inside
its own region. What is saved: ``x``, ``m`` and ``log(s)`` instead of the output. Inductor's
min-cut partitioner gets the same effect by recomputing; this is the one place it pays most.

Only a log-softmax whose every forward use is a gather along its row (cross-entropy's) is
rewritten: another forward use needs the whole output in the forward, and then saving it costs
nothing more.
"""

from __future__ import annotations

import torch
from torch import fx

from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass
from accelrun.compile.passes.dce import eliminate_dead_code
from accelrun.compile.passes.graph_build import NodeBuilder, tensor_val

aten = torch.ops.aten


def _forward_nodes(graph: fx.Graph, num_fwd_outputs: int) -> set[fx.Node]:
    """The nodes the forward outputs need (what the partitioner puts in the forward graph)."""
    (outputs,) = graph.find_nodes(op="output")
    flat = outputs.args[0] if isinstance(outputs.args[0], (list, tuple)) else [outputs.args[0]]
    seen: set[fx.Node] = set()
    stack = [n for n in flat[:num_fwd_outputs] if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _uses_through_aliases(node: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(user, the node it reads) for every non-alias use of ``node`` or of an alias of it."""
    out, stack = [], [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user.op == "call_function" and user.target is aten.alias.default:
                stack.append(user)
            else:
                out.append((user, current))
    return out


def _row_gather(user: fx.Node, read: fx.Node, dim: int, x: torch.Tensor) -> bool:
    """``gather(read, dim, index)`` whose index covers every other axis of ``x`` in full."""
    if user.target is not aten.gather.default or user.args[0] is not read or len(user.args) < 3:
        return False
    if user.kwargs.get("sparse_grad") or (len(user.args) > 3 and user.args[3]):
        return False
    index = tensor_val(user.args[2])
    along = user.args[1] % x.dim()
    return (index is not None and along == dim and index.dim() == x.dim()
            and all(index.shape[d] == x.shape[d] for d in range(x.dim()) if d != dim))  # fmt: skip


# Ops that read only their input's shape (and dtype): a full tensor of the value each gives.
_FILLED_LIKE = {
    aten.full_like.default: lambda node: node.args[1],
    aten.zeros_like.default: lambda node: 0,
    aten.ones_like.default: lambda node: 1,
}


# Views that take the same arguments on a tensor of another dtype (transformers flattens the upcast
# logits to rows before the loss: ``logits.float().view(-1, vocab)``).
_LAYOUT_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


def _upcast_source(build: NodeBuilder, node: fx.Node, before: fx.Node) -> fx.Node | None:
    """The lower-precision tensor ``node`` is a plain float upcast of (``_to_copy`` to another float
    dtype on the same device, nothing else changed), viewed as ``node`` views the upcast; or None."""
    views = []
    while node.op == "call_function" and node.target in _LAYOUT_VIEWS and isinstance(node.args[0], fx.Node):
        views.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target is not aten._to_copy.default or set(node.kwargs) - {"dtype"}:
        return None
    src, out = tensor_val(node.args[0]), tensor_val(node)
    if src is None or out is None or src.device != out.device:
        return None
    if not (src.dtype.is_floating_point and out.dtype.is_floating_point) or src.dtype.itemsize >= out.dtype.itemsize:
        return None
    if views and src.stride() != out.stride():
        return None  # the views are taken again on the source: it must be laid out as its upcast
    viewed = node.args[0]
    for view in reversed(views):
        viewed = build(before, view.target, viewed, *view.args[1:], **view.kwargs)
    return viewed


def _rewrite(build: NodeBuilder, ls: fx.Node, dim: int, uses: list[tuple[fx.Node, fx.Node]],
             in_forward: set[fx.Node]) -> None:
    x_node = ls.args[0]
    x, out = tensor_val(x_node), tensor_val(ls)
    # x read again, in the backward and by the gathers, from what it was cast from when it is an
    # upcast (bf16 logits made fp32): half the bytes saved, and the forward's fp32 copy stays inside
    # the statistics' region.
    src = _upcast_source(build, x_node, ls)
    m = build(ls, aten.amax.default, x_node, [dim], True)
    s = build(ls, aten.sum.dim_IntList, build(ls, aten.exp.default, build(ls, aten.sub.Tensor, x_node, m)), [dim], True)
    log_s = build(ls, aten.log.default, s)

    def normalised(before: fx.Node, t: fx.Node) -> fx.Node:  # (t - m) - log(s), as ATen's decomposition
        return build(before, aten.sub.Tensor, build(before, aten.sub.Tensor, t, m), log_s)

    for user, read in uses:
        if user in in_forward:  # the loss's entries, read from x
            if src is None:
                picked = build(user, aten.gather.default, x_node, dim, user.args[2])
            else:
                picked = build(user, aten._to_copy.default, build(user, aten.gather.default, src, dim, user.args[2]),
                               dtype=x.dtype)  # fmt: skip
            user.replace_all_uses_with(normalised(user, picked))
            build.graph.erase_node(user)
        elif user.target in _FILLED_LIKE:  # full_like(output, 0): only its shape and dtype are read
            filled = build(user, aten.full.default, list(out.shape), _FILLED_LIKE[user.target](user), dtype=out.dtype,
                           layout=torch.strided, device=out.device, pin_memory=False)  # fmt: skip
            user.replace_all_uses_with(filled)
            build.graph.erase_node(user)
        else:  # the backward's: the output recomputed next to its use
            again = x_node if src is None else build(user, aten._to_copy.default, src, dtype=x.dtype)
            user.replace_input_with(read, normalised(user, again))


@register_pass("loss_row_stats", "joint", PassOptions)
def loss_row_stats(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Save a log-softmax's row max and log-sum-exp instead of its output (cross-entropy's); the
    backward recomputes the output from its input."""
    num_fwd_outputs = ctx.notes.num_fwd_outputs
    if num_fwd_outputs is None:
        return PassResult(changed=False, summary="the number of forward outputs is unknown: nothing rewritten")
    graph, build = gm.graph, NodeBuilder(gm)
    found = graph.find_nodes(op="call_function", target=aten._log_softmax.default)
    candidates = list(found) if build.fake_mode is not None else []  # no fake values: nothing can be built
    forward = _forward_nodes(graph, num_fwd_outputs) if candidates else set()
    rewritten = 0
    for ls in candidates:
        x_node, dim, half_to_float = ls.args
        x, out = tensor_val(x_node), tensor_val(ls)
        if half_to_float or x is None or out is None or out.dtype != x.dtype or ls not in forward:
            continue
        if not all(isinstance(s, int) for s in x.shape):  # comparing an unbacked size would guard on it
            continue
        dim %= x.dim()
        uses = _uses_through_aliases(ls)
        # The output node is a forward use: the function returns the log-softmax itself.
        in_forward = {user for user, _ in uses if user in forward or user.op == "output"}
        if all(user in in_forward for user, _ in uses):
            continue  # nothing of it reaches the backward: nothing saved to spare
        if not all(user not in in_forward or _row_gather(user, read, dim, x) for user, read in uses):
            continue
        _rewrite(build, ls, dim, uses, in_forward)
        rewritten += 1
    if not rewritten:
        return PassResult(changed=False, summary="no log-softmax saved for a backward")
    eliminate_dead_code(graph)
    graph.lint()
    gm.recompile()
    return PassResult(changed=True, summary=f"{rewritten} log-softmax(es) saved as row statistics",
                      counts={"log_softmax": rewritten})

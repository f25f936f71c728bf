"""reinplace: an op that writes into a copy of a tensor that nothing else reads writes into that tensor.

AOTAutograd hands the compiler functional graphs. A user's ``out.index_add(0, rows, v)``, an
``out[rows] += v``, and the backward of every ``x[rows]`` (zeros, then the gradient's rows put in)
become ``index_put(base, [rows], values, accumulate)``: a copy of the whole base, then the write. A
mixture of experts does that once per expert, forward and backward, on tensors the size of all its
tokens. Where the base is a tensor made in the graph (zeros, or the result of another such write)
and this op is its only reader, the copy buys nothing, and the op runs in place (``index_put_``) on
it. Inductor reinplaces the same way.

Bases made by the graph only: an input may be a parameter or alias the caller's tensors, and a
base read anywhere else (a second write, a saved tensor, the graph's output) must keep its value.
``cse`` merges equal ``zeros`` (every expert's gradient starts from the same one); each such write
gets a ``zeros`` of its own, a fill instead of a copy. Runs after ``cse``, which would merge them
back.
"""

from __future__ import annotations

import torch
from torch import fx

from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass

aten = torch.ops.aten

# out-of-place op → the same op in place (the same arguments; it returns its first one, written).
IN_PLACE = {
    aten.index_put.default: aten.index_put_.default,
    aten.index_add.default: aten.index_add_.default,
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.scatter_add.default: aten.scatter_add_.default,
    aten.masked_fill.Scalar: aten.masked_fill_.Scalar,
}
# Ops that make a tensor from numbers (and at most another's shape): another call makes an equal one.
FACTORIES = frozenset({
    aten.full.default, aten.full_like.default, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default,
    aten.new_full.default,
})  # fmt: skip
WRITES_IN_PLACE = frozenset(IN_PLACE.values())


def _made_here(node: fx.Node) -> bool:
    """A tensor only this graph can see: made by a factory or an out-of-place write (a new tensor, not a
    view), or by an in-place write into such a tensor (not into an input it was given)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in WRITES_IN_PLACE:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "call_function" and (node.target in FACTORIES
                                                                          or node.target in IN_PLACE)


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    return va.dtype == vb.dtype and va.shape == vb.shape and va.stride() == vb.stride()


def _reads_again(node: fx.Node, base: fx.Node) -> bool:
    """Whether ``node`` reads ``base`` past its first argument too (as the values it writes)."""
    seen: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), seen.append)
    return base in seen


@register_pass("reinplace", "post_grad", PassOptions)
def reinplace(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Writes into a copy of a tensor made in the graph and read nowhere else run in place."""
    rewritten = made = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in IN_PLACE or not node.args:
            continue
        base = node.args[0]
        if not _made_here(base):
            continue
        if not _same_layout(base, node) or _reads_again(node, base):
            continue
        if len(base.users) > 1:
            if base.target not in FACTORIES:
                continue
            with gm.graph.inserting_before(node):  # a zeros of its own, made where it is written
                own = gm.graph.call_function(base.target, base.args, base.kwargs)
            own.meta = dict(base.meta)
            node.replace_input_with(base, own)
            made += 1
        node.target = IN_PLACE[node.target]
        rewritten += 1
    if rewritten:
        gm.recompile()
    return PassResult(changed=rewritten > 0, summary=f"{rewritten} writes in place ({made} with a base of their own)",
                      counts={"rewritten": rewritten, "own_base": made})

"""cpu_dropout: a training dropout on a CPU tensor draws its mask inside the fusion region around it.

ATen's ``native_dropout`` fills its mask with ``bernoulli_``, one Mersenne Twister draw an element (a
third of a nanoGPT-shaped step on this project's CPUs), and as an op of its own it splits the pointwise
work around it (softmax before it, a residual add and a norm after it) into separate regions. Here
each ``native_dropout(x, p, train=True)`` of a forward graph becomes

    seed = randint(0, 2^62)                            # one draw from torch's generator per call
    keep = dropout_uniform(seed, x.shape) >= p         # fused/dropout.py: a function of (seed, index)
    out  = x * keep * (1 / (1 - p))                    # ATen's formula, on ATen's mask type (bool)

and the partitioner fuses those with their neighbours; the backward still reads ``keep`` as the saved
mask. Masks differ from eager's (another generator, as Inductor's do), are decided by
``torch.manual_seed`` and keep each element with probability 1 - p. Left alone: a dropout that is not
training, p of 0 or 1, a tensor off the CPU or not contiguous (the saved mask must keep eager's
layout), and dtypes the C++ generator does not store (fp16). A size that changes between calls (a
symbol in the graph: batches of other lengths) is drawn for as the graph's input that holds it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from accelrun.compile.fused.dropout import SEED_HIGH
from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass, rewrites_result
from accelrun.compile.passes.graph_build import NodeBuilder, tensor_val

aten = torch.ops.aten
DTYPES = (torch.float32, torch.bfloat16)


def _why_not(node: fx.Node) -> str | None:
    """Why this native_dropout call stays ATen's, or None if it is rewritten."""
    x = tensor_val(node.args[0])
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    if x is None or not isinstance(p, (int, float)) or train is not True:
        return "not a training dropout with a fixed p"
    if not 0.0 < p < 1.0:
        return f"p = {p}"
    if x.device.type != "cpu":
        return f"on {x.device.type}"
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype}"
    if not x.is_contiguous():
        return "input not contiguous"
    if any(u.target is not operator.getitem for u in node.users):
        return "its result is used whole"
    return None


def _size_of(gm: fx.GraphModule, val: torch.Tensor) -> list[int | fx.Node] | None:
    """``val``'s sizes as the numbers draws are made for: whole numbers, and for a size that changes
    between calls (a sequence's length; a symbol in the graph) the graph's input that holds it. None
    where a changing size is no input's (a product of sizes, ``16*s``)."""
    given = {n.meta["val"].node.expr: n for n in gm.graph.find_nodes(op="placeholder")
             if isinstance(n.meta.get("val"), torch.SymInt)}  # fmt: skip
    size: list[int | fx.Node] = []
    for n in val.shape:
        if isinstance(n, int):
            size.append(n)
        elif (node := given.get(n.node.expr)) is not None:
            size.append(node)
        else:
            return None
    return size


def _not_drawn_at_each_call(nodes: list[fx.Node]) -> str | None:
    """Why the rewritten dropout (``nodes``: the draw, the mask, the two multiplies), over a size that
    changes between calls, would get no kernel that reads its rows at each call (the draw's index
    splits across the rows: ``[4, s]``, ``[4, 5, s]``), or None. Where it gets none, its region would
    run as ATen calls in the graph for any length (the draw's compiled fill is still a pass of its own
    over memory, as ATen's dropout is) and would make Dynamo compile a graph for the second length
    whose kernels read that length as a number: such a dropout stays ATen's."""
    from accelrun.compile.codegen.loop_ir import Unsupported
    from accelrun.compile.codegen.runtime_rows import lower_with_runtime_rows
    from accelrun.compile.extract import region_of

    try:  # returning the mask (saved for the backward) and the result
        lower_with_runtime_rows(region_of(0, nodes, outputs=[nodes[1], nodes[-1]]))
    except Unsupported as e:
        return f"a size that changes between calls, whose rows no kernel reads at each call ({e})"
    return None


@register_pass("cpu_dropout", "post_grad", PassOptions)
def cpu_dropout(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Training dropouts on CPU tensors draw their masks in the fusion regions around them."""
    if ctx.graph_kind == "backward":
        return PassResult(changed=False, summary="a backward graph draws no masks")
    build = NodeBuilder(gm)
    if build.fake_mode is None:
        return PassResult(changed=False, summary="no fake values: left as is")
    rewritten, kept = 0, {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.native_dropout.default:
            continue
        why = _why_not(node)
        x, val = node.args[0], tensor_val(node.args[0])
        size = _size_of(gm, val) if why is None else None
        if why is None and size is None:
            why = "a size that changes between calls that the graph is not given as a number"
        if why is not None:
            kept[why] = kept.get(why, 0) + 1
            continue
        p = float(node.args[1])
        seed = build(node, aten.randint.low, 0, SEED_HIGH, [], dtype=torch.int64, device=val.device)
        uniform = build(node, torch.ops.accelrun.dropout_uniform.default, seed, size)
        keep = build(node, aten.ge.Scalar, uniform, p)
        scaled = build(node, aten.mul.Tensor, x, keep)
        out = build(node, aten.mul.Scalar, scaled, 1.0 / (1.0 - p))
        if any(isinstance(n, fx.Node) for n in size) and (why := _not_drawn_at_each_call([uniform, keep, scaled, out])):
            for new in (out, scaled, keep, uniform, seed):
                gm.graph.erase_node(new)
            kept[why] = kept.get(why, 0) + 1
            continue
        for new in (seed, uniform, keep, scaled, out):
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        for user in list(node.users):
            user.replace_all_uses_with(out if user.args[1] == 0 else keep)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        rewritten += 1
    return rewrites_result(gm, rewritten, kept, "dropout(s) draw their masks in kernels")

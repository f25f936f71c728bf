"""cpu_half_gemm: bf16 / fp16 matrix products on a CPU without half-precision GEMM run as fp32 GEMMs.

Where ATen has no oneDNN kernel for a half-precision dtype (``cpu_has_half_gemm``: on x86, bf16 needs
AVX-512 BW/VL/DQ or AVX-NE-CONVERT), it multiplies that dtype in a generic loop: on this project's
AVX2 machine a bf16 ``mm`` runs at 1-15 GFLOP/s against 100 in fp32, so a bf16-mixed step is 13-17x
slower than an fp32 one. Here each ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` whose inputs are all bf16
(or all fp16) becomes the same product on its inputs cast to fp32 (each tensor once), its result cast
back. The products of two bf16 (or fp16) numbers are exact in fp32 and the sums are fp32 sums, as a
half-precision GEMM accumulates: the result differs from ATen's only in summation order, then rounds
once to the output's dtype. A cast beside other pointwise ops joins their fusion region; a
parameter's runs alone. An input that is a view (a transpose, a reshape) of another tensor is cast
as that tensor, the view taken of the fp32 copy: a backward reads an activation both as it is and
transposed (input and weight gradients), and one fp32 copy then serves both.

Where the CPU has the kernel, or the product is not on the CPU, the graph is left as it is.
"""

from __future__ import annotations

import torch
from torch import fx

from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass
from accelrun.compile.passes.graph_build import NodeBuilder, tensor_val
from accelrun.torch_private import cpu_has_half_gemm

aten = torch.ops.aten

HALF = (torch.bfloat16, torch.float16)
# The products this pass rewrites, and the positions of their tensor arguments.
PRODUCTS = {
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (0, 1, 2),
    aten.baddbmm.default: (0, 1, 2),
}


def _rewritable(node: fx.Node) -> torch.dtype | None:
    """The half dtype of a CPU product whose tensor inputs all share it, or None."""
    if node.op != "call_function" or node.target not in PRODUCTS:
        return None
    vals = [tensor_val(node.args[i]) if i < len(node.args) else None for i in PRODUCTS[node.target]]
    out = tensor_val(node)
    if out is None or any(v is None for v in vals) or out.device.type != "cpu":
        return None
    dtype = out.dtype
    if dtype not in HALF or any(v.dtype != dtype for v in vals) or cpu_has_half_gemm(dtype):
        return None
    return dtype


# Views that keep every element of their input: casting the input and taking the view of the copy is
# the same tensor, and the copy is no larger (a slice's input would be).
WHOLE_VIEWS = (aten.permute.default, aten.t.default, aten.transpose.int, aten.view.default,
               aten._unsafe_view.default, aten.expand.default)  # fmt: skip


def _reads_sizes(view: fx.Node) -> bool:
    """Whether ``view``'s arguments past its input are nodes (symbolic sizes): such a view is left as it
    is, since its fp32 twin would need those sizes' values, which the pass does not have at hand."""
    nodes: list[fx.Node] = []
    fx.node.map_arg((view.args[1:], view.kwargs), nodes.append)
    return bool(nodes)


def _view_chain(node: fx.Node, dtype: torch.dtype) -> tuple[fx.Node, list[fx.Node]]:
    """(the tensor ``node`` is a chain of whole views of, those views from the innermost out)."""
    views: list[fx.Node] = []
    while (node.op == "call_function" and node.target in WHOLE_VIEWS and isinstance(node.args[0], fx.Node)
           and not _reads_sizes(node) and (base := tensor_val(node.args[0])) is not None
           and base.dtype == dtype):  # fmt: skip
        views.append(node)
        node = node.args[0]
    return node, views[::-1]


def _described(new: fx.Node, like: fx.Node) -> fx.Node:
    """``new`` with ``like``'s description (its source line and module path, for dumps and explain)."""
    new.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
    return new


@register_pass("cpu_half_gemm", "post_grad", PassOptions)
def cpu_half_gemm(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Half-precision matrix products on a CPU without a kernel for them run as fp32 GEMMs (exact
    products, fp32 sums), their inputs and result cast around them."""
    build = NodeBuilder(gm)
    if build.fake_mode is None:
        return PassResult(changed=False, summary="no fake values: left as is")
    n = 0
    upcast: dict[fx.Node, fx.Node] = {}  # one cast per tensor, however many products read it
    for node in list(gm.graph.nodes):
        dtype = _rewritable(node)
        if dtype is None:
            continue
        args = list(node.args)
        for i in PRODUCTS[node.target]:
            root, views = _view_chain(args[i], dtype)
            if root not in upcast:
                upcast[root] = _described(build(node, aten._to_copy.default, root, dtype=torch.float32), node)
            value = upcast[root]
            for view in views:  # the same views of the fp32 copy (each built once, like the cast)
                if view not in upcast:
                    upcast[view] = _described(build(node, view.target, value, *view.args[1:], **view.kwargs), view)
                value = upcast[view]
            args[i] = value
        product = _described(build(node, node.target, *args, **node.kwargs), node)
        result = _described(build(node, aten._to_copy.default, product, dtype=dtype), node)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        n += 1
    for view in reversed(list(upcast)):  # half-precision views only the products read (outermost first)
        if view.op == "call_function" and view.target in WHOLE_VIEWS and not view.users:
            gm.graph.erase_node(view)
    if n:
        gm.graph.lint()
        gm.recompile()
    return PassResult(changed=n > 0, summary=f"{n} half-precision products as fp32 GEMMs", counts={"rewritten": n})

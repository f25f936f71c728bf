"""cpu_depthwise_conv: depthwise 1-d convolutions on the CPU -> accelrun's C++ kernel.

In a forward graph each ATen ``convolution`` that is a depthwise ``Conv1d`` (one filter per channel,
stride 1, dilation 1; ``fused.depthwise_conv.problem`` says which) becomes
``accelrun::depthwise_conv1d``; in a backward graph each such ``convolution_backward`` becomes
``accelrun::depthwise_conv1d_backward``, which computes the input's, the weight's and the bias's
gradients in one pass over the rows. Convolutions of other kinds (2-d, grouped, dense, on a GPU) stay
ATen's without a word; a depthwise 1-d one the kernel does not take is counted with the reason.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from accelrun.compile.fused import depthwise_conv as kernel
from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass, rewrites_result
from accelrun.compile.passes.graph_build import NodeBuilder, tensor_val

aten = torch.ops.aten
NOT_REPORTED = (kernel.NOT_ON_CPU, kernel.NOT_DEPTHWISE_1D)


def _forward_call(node: fx.Node) -> tuple[str | None, tuple]:
    """(why not, the kernel's arguments) for an ATen ``convolution`` node."""
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
    vals = [tensor_val(x), tensor_val(w), tensor_val(bias) if bias is not None else None]
    if vals[0] is None or vals[1] is None or (bias is not None and vals[2] is None):
        return "no example values", ()
    why = kernel.problem(*vals, stride, padding, dilation, transposed, output_padding, groups)
    if why is None and not _contiguous(node):
        why = "the graph wants its output in another layout"
    return why, (x, w, bias, padding[0])


def _backward_call(node: fx.Node) -> tuple[str | None, tuple]:
    """(why not, the kernel's arguments) for an ATen ``convolution_backward`` node."""
    grad_out, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = node.args
    vals = [tensor_val(x), tensor_val(w)]
    if vals[0] is None or vals[1] is None or tensor_val(grad_out) is None:
        return "no example values", ()
    why = kernel.problem(*vals, None, stride, padding, dilation, transposed, output_padding, groups)
    if why is None and tensor_val(grad_out).dtype != vals[0].dtype:
        why = "a gradient of another dtype than the input's"
    read = {u.args[1] for u in node.users if u.target is operator.getitem}
    if why is None and (len(read) != len(node.users) or any(not mask[i] for i in read)):
        why = "its result is used other than gradient by gradient"
    if why is None and not _contiguous(node):
        why = "the graph wants a gradient in another layout"
    return why, (grad_out, x, w, padding[0], *(bool(m) for m in mask))


def _contiguous(node: fx.Node) -> bool:
    """Whether ``node``'s value (each tensor of it) is contiguous, as the kernel writes its outputs."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return all(v is None or (isinstance(v, torch.Tensor) and v.is_contiguous()) for v in vals)


REWRITES = {
    aten.convolution.default: (_forward_call, torch.ops.accelrun.depthwise_conv1d.default),
    aten.convolution_backward.default: (_backward_call, torch.ops.accelrun.depthwise_conv1d_backward.default),
}


@register_pass("cpu_depthwise_conv", "post_grad", PassOptions)
def cpu_depthwise_conv(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Depthwise 1-d convolutions on CPU tensors, forward and backward, run accelrun's C++ kernel."""
    build = NodeBuilder(gm)
    rewritten, kept, dtypes = 0, {}, set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in REWRITES:
            continue
        call, target = REWRITES[node.target]
        why, args = call(node)
        if why is None and build.fake_mode is None:
            why = "no fake values"
        if why is not None:
            if why not in NOT_REPORTED:
                kept[why] = kept.get(why, 0) + 1
            continue
        new = build(node, target, *args)
        new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        dtypes.add(tensor_val(args[1]).dtype)
        rewritten += 1
    for dtype in dtypes:  # g++ runs beside the rest of compilation; the first call waits for it if need be
        kernel.LIBRARY.build_in_background(dtype)
    return rewrites_result(gm, rewritten, kept, "depthwise convolution(s) run accelrun's kernel")

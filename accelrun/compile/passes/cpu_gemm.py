"""cpu_gemm: fp32 matrix products on a CPU run through whichever library is faster for their layout here.

Each ``mm`` and ``addmm`` (a 1-D bias, no scaling) whose operands are fp32 CPU matrices, each
row-major or column-major, asks ``gemm_choice`` which library multiplies that layout faster on this
machine: ATen's (MKL) or oneDNN's (timed the first time a layout is seen, then read from a file).
Where oneDNN wins, the product becomes oneDNN's linear layer on the same operands (``b``'s transpose
as its weight: a view, no copy). A product of symbolic sizes (a graph for any sequence length) becomes
a site that chooses at each call, by the call's sizes (``ChangingSizeGemmSite``): no size is guarded.
Everything else is left as it is: other dtypes (bf16 products already run on oneDNN inside ATen),
batched products, products on other devices.

``library``: ``tuned`` (the default) times; ``onednn`` or ``aten`` decide without timing (tests, and a
user who has measured for themselves).
"""

from __future__ import annotations

import torch
from torch import fx

from accelrun.compile.gemm_choice import (
    ChangingGemmLayout,
    ChangingSizeGemmSite,
    GemmLayout,
    GemmSite,
    Library,
    matrix_order,
    tuner_for,
)
from accelrun.compile.passes.base import PassContext, PassResult, register_pass
from accelrun.compile.passes.graph_build import tensor_val
from accelrun.compile.pattern import same_size
from accelrun.config.compile_names import CpuGemmOptions
from accelrun.torch_private import onednn_linear

aten = torch.ops.aten


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(a, b, bias) of an ``mm`` or of an ``addmm(bias, a, b)`` with no beta or alpha; else None."""
    if node.op != "call_function" or node.kwargs and set(node.kwargs) - {"beta", "alpha"}:
        return None
    if node.target == aten.mm.default and len(node.args) == 2:
        return node.args[0], node.args[1], None
    if node.target == aten.addmm.default and len(node.args) == 3:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        return node.args[1], node.args[2], node.args[0]
    return None


def layout_of(node: fx.Node) -> tuple[GemmLayout | ChangingGemmLayout, fx.Node, fx.Node, fx.Node | None] | None:
    """The product's layout and operands, when oneDNN's linear layer can compute it; else None."""
    operands = _operands(node)
    if operands is None:
        return None
    a, b, bias = operands
    vals = [tensor_val(a), tensor_val(b), tensor_val(node)]
    if any(v is None for v in vals) or (bias is not None and tensor_val(bias) is None):
        return None
    va, vb, out = vals
    if any(v.dtype != torch.float32 or v.device.type != "cpu" for v in vals):
        return None
    a_col, b_col = matrix_order(va), matrix_order(vb)
    if a_col is None or b_col is None:
        return None
    if bias is not None:
        vbias = tensor_val(bias)
        if vbias.dtype != torch.float32 or vbias.dim() != 1:
            return None
        if not (same_size(vbias.shape[0], vb.shape[1]) and same_size(vbias.stride(0), 1)):
            return None
    sizes = (*va.shape, vb.shape[1])
    if all(isinstance(x, int) for x in sizes):
        return GemmLayout(*sizes, a_col, b_col, bias is not None), a, b, bias
    # A graph for any length: each call's sizes choose (ChangingSizeGemmSite); nothing is guarded.
    fixed = tuple(x if isinstance(x, int) else None for x in sizes)
    return ChangingGemmLayout(fixed, a_col, b_col, bias is not None), a, b, bias


@register_pass("cpu_gemm", "post_grad", CpuGemmOptions)
def cpu_gemm(gm: fx.GraphModule, options: CpuGemmOptions, ctx: PassContext) -> PassResult:
    """fp32 CPU matrix products run through oneDNN where it multiplies their layout faster than ATen's
    MKL on this machine (timed on the product's first calls, once per layout and machine, then cached)."""
    if options.library == "aten" or onednn_linear() is None:
        return PassResult(changed=False, summary="left to ATen" if options.library == "aten" else "no oneDNN in this torch")
    fixed = Library.ONEDNN if options.library == "onednn" else None
    sites: list[GemmSite] = []
    for node in list(gm.graph.nodes):
        found = layout_of(node)
        if found is None:
            continue
        layout, a, b, bias = found
        if isinstance(layout, ChangingGemmLayout):
            site = ChangingSizeGemmSite(layout, fixed)
        elif fixed is None and tuner_for(layout).library is Library.ATEN:
            continue  # decided before: ATen's own op stays (readable, and fast_calls' method call)
        else:
            site = GemmSite(layout, fixed)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(site, (a, b) if bias is None else (a, b, bias))
        new.meta.update(node.meta)  # the same value: oneDNN's result is contiguous, as ATen's
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        sites.append(site)
    if sites:
        gm.graph.lint()
        gm.recompile()
    undecided = sum(1 for s in sites if s.fixed is None and (s.tuner is None or s.tuner.library is None))
    summary = f"{len(sites) - undecided} fp32 products on oneDNN, {undecided} to be timed on their first calls"
    return PassResult(changed=bool(sites), summary=summary,
                      counts={"onednn": len(sites) - undecided, "timed_at_first_calls": undecided})  # fmt: skip


# On an ATen product that was a site, while fx's pickler saves the graph: the site, rebuilt on load.
SITE_KEY = "accelrun_gemm_site"


def restore_aten_products(gm: fx.GraphModule) -> int:
    """Each product site back to ATen's op, the site kept in the node's meta: fx's pickler saves ops by
    name only (``reinstate_sites`` undoes it after loading). The number restored."""
    sites = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, GemmSite)]
    for node in sites:
        a, b, *bias = node.args
        args = (a, b) if not bias else (bias[0], a, b)
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(aten.mm.default if not bias else aten.addmm.default, args)
        product.meta.update(node.meta)
        product.meta[SITE_KEY] = node.target  # pickled as its class, layout and fixed library
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
    if sites:
        gm.recompile()
    return len(sites)


def reinstate_sites(gm: fx.GraphModule) -> int:
    """The sites ``restore_aten_products`` turned into ATen products, sites again; the number."""
    products = [n for n in gm.graph.nodes if n.op == "call_function" and SITE_KEY in n.meta]
    for node in products:
        saved = node.meta.pop(SITE_KEY)
        args = node.args if node.target == aten.mm.default else (node.args[1], node.args[2], node.args[0])
        with gm.graph.inserting_before(node):
            site = gm.graph.call_function(saved, args)
        site.meta.update(node.meta)
        node.replace_all_uses_with(site)
        gm.graph.erase_node(node)
    if products:
        gm.recompile()
    return len(products)

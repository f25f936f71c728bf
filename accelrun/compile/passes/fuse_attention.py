"""fuse_attention: attention written out by hand -> ``F.scaled_dot_product_attention``.

Matches ``softmax(q @ k^T * scale [masked], dim=-1) @ v``: k^T as ``k.transpose(-2, -1)`` or ``k.mT``;
the scale as ``* s``, ``/ d`` or on q (``(q * s) @ k^T``), or none; the mask as
``masked_fill(mask, -inf)``, ``where(keep, scores, -inf)`` or ``+ additive_mask``; an fp32 upcast
before the softmax and a cast back after it; dropout with p=0. A mask that is a constant of the graph
(built from shapes, e.g. ``torch.triu(torch.ones(T, T), 1)``) is evaluated at compile time and becomes
``is_causal=True`` when it is the causal mask; any other mask is passed as ``attn_mask``.

``nn.MultiheadAttention`` reaches Dynamo's graph as one ``F.multi_head_attention_forward`` call, its
mask already a float one (0 / -inf). Self-attention in the plain case (no key padding mask, no extra
key/value bias, ``need_weights=False``, as ``TransformerEncoderLayer`` calls it) under a causal mask
built from shapes, or under any mask given with ``is_causal=True`` (torch.nn then drops the mask and
passes the flag itself), is unfolded into that function's own steps with SDPA's ``is_causal=True``: on
a CPU ``cpu_attention`` then runs it in accelrun's kernel, and elsewhere ATen's kernels skip the
masked half. A mask whose values the graph cannot see (given as an input, or made from a length that
changes between calls) is unfolded with SDPA given the mask, which ``cpu_attention`` looks at when it runs.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from accelrun.compile.passes.base import PassContext, PassResult, register_pass
from accelrun.compile.pattern import (
    Match,
    Maybe,
    Num,
    OneOf,
    Op,
    Tensor,
    Var,
    erase_dead,
    example_value,
    float32_cast,
    is_dim,
    iter_matches,
    replace_with_call,
    rewrite_all,
    same_size,
    shape_but_length,
    static_shape,
)
from accelrun.config.compile_names import FuseAttentionOptions

_Q, _K, _V = Tensor("q"), Tensor("k"), Tensor("v")
_K_T = OneOf(Op("transpose", _K, Var("t_dim0"), Var("t_dim1")), Op("attr.mT", _K))
# Prescaled q first: otherwise q would bind to the (q * s) node and the scale be lost to SDPA.
_QK = OneOf(Op("matmul", Op("mul", _Q, Num("q_scale")), _K_T), Op("matmul", _Q, _K_T))
_SCALED = OneOf(Op("mul", _QK, Num("scale")), Op("div", _QK, Num("divisor")), _QK)
_MASKED = OneOf(
    Op("masked_fill", _SCALED, Tensor("drop_mask"), Num("fill")),
    Op("where", Tensor("keep_mask"), _SCALED, Num("fill")),
    Op("add", _SCALED, Tensor("add_mask")),
    _SCALED,
)
_PROBS = Op("softmax", OneOf(float32_cast(_MASKED), _MASKED), Var("softmax_dim"), dtype=Var("softmax_dtype"))
_CAST_BACK = OneOf(Op("type_as", _PROBS, Tensor("cast_like")), Op("to", _PROBS, Var("cast_dtype")), _PROBS)
PATTERN = Op("matmul", Maybe("dropout", _CAST_BACK, p=Num("dropout_p"), training=Var("training")), _V)


def _acceptable(m: Match) -> bool:
    q, k, v = (example_value(m[n]) for n in ("q", "k", "v"))
    out = example_value(m.anchor)
    if q is None or k is None or v is None or out is None:
        return False
    ndim = len(q.shape)
    if ndim < 3 or len(k.shape) != ndim or len(v.shape) != ndim or not q.dtype.is_floating_point:
        return False
    if not (q.dtype == k.dtype == v.dtype == out.dtype):
        return False  # SDPA returns q's dtype; the written-out version must agree
    if "t_dim0" in m.bindings:
        d0, d1 = m["t_dim0"], m["t_dim1"]
        swaps_last_two = (is_dim(d0, ndim, -1) and is_dim(d1, ndim, -2)) or (
            is_dim(d0, ndim, -2) and is_dim(d1, ndim, -1)
        )
        if not swaps_last_two:
            return False
    if not is_dim(m["softmax_dim"], ndim, -1):
        return False
    if m.get("dropout_p", 0.0) != 0.0:
        return False
    if "fill" in m.bindings and not (m["fill"] == -math.inf or m["fill"] <= torch.finfo(q.dtype).min):
        return False
    # An fp32 additive mask on half scores (a mask built in fp32 under autocast, as Meta's Llama code
    # builds it) is taken too: the call gets it cast to q's dtype, which SDPA requires.
    add_dtypes = (q.dtype, torch.float32) if q.dtype in (torch.bfloat16, torch.float16) else (q.dtype,)
    for name, ok_dtypes in (("drop_mask", (torch.bool,)), ("keep_mask", (torch.bool,)), ("add_mask", add_dtypes)):
        if name in m.bindings:
            mask = example_value(m[name])
            if mask is None or mask.dtype not in ok_dtypes:
                return False
    return True


def _scale(m: Match) -> float:
    scale = float(m.get("q_scale", 1.0))
    if "scale" in m.bindings:
        scale *= m["scale"]
    if "divisor" in m.bindings:
        scale /= m["divisor"]
    return scale


def constant_value(node: fx.Node, budget: int = 32) -> torch.Tensor | None:
    """Evaluate ``node`` if it depends on no graph input (a mask built from shapes); else None."""
    if budget <= 0 or node.op not in ("call_function", "call_method"):
        return None
    values = {}
    for inp in node.all_input_nodes:
        value = constant_value(inp, budget - 1)
        if value is None:
            return None
        values[inp] = value
    args = fx.node.map_arg(node.args, values.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
    try:
        with torch.no_grad():
            if node.op == "call_method":
                result = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                result = node.target(*args, **kwargs)
    except Exception:
        return None
    if isinstance(result, torch.Tensor) and result.numel() > 1 << 24:
        return None
    return result


def _is_causal(m: Match, mask_name: str) -> bool:
    q_shape, k_shape = static_shape(m["q"]), static_shape(m["k"])
    if q_shape is None or k_shape is None:
        return False
    value = constant_value(m[mask_name])
    if not isinstance(value, torch.Tensor):
        return False
    keep = torch.ones(q_shape[-2], k_shape[-2], dtype=torch.bool).tril()  # SDPA's is_causal: top-left
    try:
        value = value.cpu().broadcast_to(q_shape[:-2] + keep.shape)
    except RuntimeError:
        return False
    return is_causal_value(value, keep, bool_keeps=mask_name == "keep_mask")


def is_causal_value(value: torch.Tensor, keep: torch.Tensor, bool_keeps: bool = False) -> bool:
    """Whether mask ``value`` (broadcast to ``keep``'s trailing shape) is the causal one ``keep`` says:
    a boolean mask True where masked (or where kept, ``bool_keeps``), or an additive one, 0 where kept
    and -inf where masked."""
    if value.dtype == torch.bool:
        return bool((value == (keep if bool_keeps else ~keep)).all())
    return bool(((value == 0) == keep).all() and (value[..., ~keep] == -math.inf).all())


def _rewrite(gm: fx.GraphModule, anchor: fx.Node, options: FuseAttentionOptions) -> fx.Node | None:
    for m in iter_matches(PATTERN, anchor):
        if not _acceptable(m):
            continue
        mask_name = next((n for n in ("drop_mask", "keep_mask", "add_mask") if n in m.bindings), None)
        attn_mask, is_causal = None, False
        if mask_name is not None:
            if options.detect_causal and _is_causal(m, mask_name):
                is_causal = True
            elif mask_name == "drop_mask":  # SDPA's boolean mask says which positions take part
                with gm.graph.inserting_before(anchor):
                    attn_mask = gm.graph.call_function(torch.logical_not, (m["drop_mask"],))
                    attn_mask.meta["example_value"] = example_value(m["drop_mask"])
            else:
                attn_mask = m[mask_name]
                q_dtype = example_value(m["q"]).dtype
                if mask_name == "add_mask" and example_value(attn_mask).dtype != q_dtype:
                    with gm.graph.inserting_before(anchor):
                        cast = gm.graph.call_method("to", (attn_mask, q_dtype))
                    cast.meta["example_value"] = example_value(attn_mask).to(q_dtype)
                    attn_mask = cast
        kwargs = {"attn_mask": attn_mask, "dropout_p": 0.0, "is_causal": is_causal, "scale": _scale(m)}
        return replace_with_call(gm, m, F.scaled_dot_product_attention, (m["q"], m["k"], m["v"]), kwargs)
    return None


MASK_AT_RUN_TIME = "mask at run time"  # _unfoldable_mha's mark: its mask's values are unknown while compiling

# nn.MultiheadAttention's settings under which its functional form is in-projection, SDPA, out-projection.
_MHA_PLAIN = {"bias_k": None, "bias_v": None, "add_zero_attn": False, "key_padding_mask": None, "need_weights": False,
              "use_separate_proj_weight": False, "static_k": None, "static_v": None}  # fmt: skip
_MHA_PARAMS = inspect.signature(F.multi_head_attention_forward)


def _unfoldable_mha(node: fx.Node) -> dict | None:
    """The arguments of an ``F.multi_head_attention_forward`` call (what ``nn.MultiheadAttention`` puts in
    Dynamo's graph, whole) that is self-attention in the plain case ``_MHA_PLAIN``, causal by its mask
    (built from shapes) or by ``is_causal=True``, or given a (T, T) mask whose values the graph cannot
    see (marked ``MASK_AT_RUN_TIME``); None otherwise. Its mask reaches the graph as a float one
    (0 / -inf, ``F._canonical_mask``), which no attention kernel skips work on."""
    if node.op != "call_function" or node.target is not F.multi_head_attention_forward:
        return None
    try:
        bound = _MHA_PARAMS.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    if any(a[k] is not v and a[k] != v for k, v in _MHA_PLAIN.items()) or not (a["query"] is a["key"] is a["value"]):
        return None
    shape, mask = static_shape(a["query"]) or shape_but_length(a["query"], 3, 0), a["attn_mask"]
    if shape is None or len(shape) != 3 or not isinstance(a["num_heads"], int) or shape[2] % a["num_heads"]:
        return None
    # It returns (output, weights): the output is read, the weights (None here) are not.
    if not all(u.op == "call_function" and u.target is operator.getitem and (u.args[1] == 0 or not u.users)
               for u in node.users):  # fmt: skip
        return None
    if mask is None:  # (is_causal=True without a mask is an error eagerly: left to raise it)
        return None
    if a["is_causal"] is True:  # torch.nn itself then drops the mask and gives SDPA the flag (its hint)
        return a
    value = constant_value(mask) if isinstance(mask, fx.Node) and isinstance(shape[0], int) else None
    if value is None and isinstance(mask, fx.Node):
        # A mask the graph is given (a model that builds it once, outside its blocks), or makes from a
        # length that changes between calls: SDPA with it, as the function itself calls SDPA;
        # ``cpu_attention`` looks at it when it runs (causal: the kernel). Sizes compared without a guard.
        given = example_value(mask)
        if (isinstance(given, torch.Tensor) and given.dim() == 2 and all(same_size(n, shape[0]) for n in given.shape)
                and not given.requires_grad):  # fmt: skip
            return {**a, MASK_AT_RUN_TIME: True}
        return None
    if not isinstance(value, torch.Tensor) or tuple(value.shape[-2:]) != (shape[0], shape[0]):
        return None
    keep = torch.ones(shape[0], shape[0], dtype=torch.bool).tril()
    if value.numel() != keep.numel():
        return None
    # (made on the model's device: a GPU's, there)
    return a if is_causal_value(value.cpu().reshape(shape[0], shape[0]), keep) else None


def _unfold_mha(gm: fx.GraphModule, node: fx.Node, a: dict) -> None:
    """In-projection, SDPA with ``is_causal=True`` (``cpu_attention`` takes it on a CPU), out-projection:
    ``F.multi_head_attention_forward``'s own steps for the plain case, with its (T, B, E) layout. A length
    that changes between calls is -1 in the reshapes: a symbol is no argument a graph node can hold."""
    (length, B, E), H = static_shape(a["query"]) or shape_but_length(a["query"], 3, 0), a["num_heads"]
    T = length if isinstance(length, int) else -1
    D = E // H
    p = a["dropout_p"] if a["training"] else 0.0
    g = gm.graph

    # the mode the graph's own fake values belong to (a tracing context's may be another)
    fake_mode = getattr(a["query"].meta.get("example_value"), "fake_mode", None)

    def call(target, *args, **kwargs) -> fx.Node:
        new = g.call_function(target, args, kwargs)
        values = fx.node.map_arg((args, kwargs), lambda n: n.meta.get("example_value"))
        # inside the fake mode: SDPA with dropout makes a tensor of its own (a mask) on the way
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            new.meta["example_value"] = target(*values[0], **values[1])
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in node.meta:
                new.meta[key] = node.meta[key]
        return new

    with g.inserting_before(node):
        qkv = call(torch.reshape, call(F.linear, a["query"], a["in_proj_weight"], a["in_proj_bias"]), (T, B, 3, H, D))
        q, k, v = (call(torch.permute, call(torch.select, qkv, 2, i), (1, 2, 0, 3)) for i in range(3))  # (B, H, T, D)
        if a.get(MASK_AT_RUN_TIME):  # (T, T), as the function broadcasts it over batch and heads
            mask = a["attn_mask"]
            if example_value(mask).dtype == torch.bool:  # the function's True is "masked", SDPA's "attend"
                mask = call(torch.logical_not, mask)
            mask = call(torch.unsqueeze, call(torch.unsqueeze, mask, 0), 0)
            out = call(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=p, is_causal=False)
        else:
            out = call(F.scaled_dot_product_attention, q, k, v, attn_mask=None, dropout_p=p, is_causal=True)
        rows = call(torch.reshape, call(torch.permute, out, (2, 0, 1, 3)), (-1, E))
        result = call(torch.reshape, call(F.linear, rows, a["out_proj_weight"], a["out_proj_bias"]), (T, B, E))
    for user in list(node.users):  # getitem 0: the output; 1: the weights, None with need_weights=False
        if user.args[1] == 0:
            user.replace_all_uses_with(result)
        if not user.users:
            g.erase_node(user)
    if not node.users:
        g.erase_node(node)
        erase_dead(g, [m for m in [a["attn_mask"]] if isinstance(m, fx.Node)])


@register_pass("fuse_attention", "pre_grad", FuseAttentionOptions)
def fuse_attention(gm: fx.GraphModule, options: FuseAttentionOptions, ctx: PassContext) -> PassResult:
    """Replace softmax(q k^T * scale + mask) v written out in torch ops with scaled_dot_product_attention;
    unfold nn.MultiheadAttention's self-attention under a causal mask into SDPA with ``is_causal``."""
    n = rewrite_all(gm, {"matmul"}, lambda g, node: _rewrite(g, node, options))
    # (an autocast region inside the graph would give the new nodes dtypes their example values lack)
    autocast = any(n.op == "call_function" and "autocast" in getattr(n.target, "__name__", "") for n in gm.graph.nodes)
    mha = [(node, a) for node in list(gm.graph.nodes)
           if options.detect_causal and not autocast and (a := _unfoldable_mha(node)) is not None]  # fmt: skip
    for node, a in mha:
        _unfold_mha(gm, node, a)
    if mha:
        gm.graph.lint()
        gm.recompile()
    given = sum(1 for _, a in mha if a.get(MASK_AT_RUN_TIME))
    summary = f"matched {n} attention, {len(mha) - given} causal MultiheadAttention"
    if given:
        summary += f", {given} MultiheadAttention given its mask (looked at when it runs)"
    return PassResult(changed=n + len(mha) > 0, summary=summary, counts={"matched": n, "multihead": len(mha)})

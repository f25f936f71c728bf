"""fuse_linear_cross_entropy: ``cross_entropy(linear(h, W)[.float()].flatten(0, 1), target)`` -> chunked op.

The projection is ``F.linear(h, W, b)`` or ``h @ W.t()`` / ``h @ W.T``; between it and the loss any
``.float()`` casts and flatten/view/reshape ops that fold h's leading dims into rows (the loss input
must be (N, V) with V the projection's width). Only fires when the logits have no other user (the match
must own every node from the projection to the loss), for reduction mean or sum, no class weights and no
label smoothing. The replacement ``accelrun.compile.fused.linear_cross_entropy.linear_cross_entropy``
never materialises the (N, V) logits: it works ``chunk_rows`` rows at a time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from accelrun.compile.fused.linear_cross_entropy import linear_cross_entropy
from accelrun.compile.passes.base import PassContext, PassResult, register_pass
from accelrun.compile.pattern import (
    Chain,
    Match,
    OneOf,
    Op,
    Tensor,
    Var,
    canonical_op,
    example_value,
    iter_matches,
    normalized_args,
    replace_with_call,
    rewrite_all,
    same_shape,
    same_size,
)
from accelrun.config.compile_names import FuseLinearCrossEntropyOptions

_H, _W = Tensor("h"), Tensor("w")
_W_T = OneOf(Op("t", _W), Op("attr.T", _W), Op("transpose", _W, Var("t_dim0"), Var("t_dim1")))
_PROJECTION = OneOf(Op("linear", _H, _W, Var("bias"), name="proj"), Op("matmul", _H, _W_T, name="proj"))
PATTERN = Op(
    "cross_entropy",
    Chain(("float", "to", "flatten", "view", "reshape"), _PROJECTION),
    Tensor("target"),
    ignore_index=Var("ignore_index"),
    reduction=Var("reduction"),
    name="loss",
)


def _acceptable(m: Match) -> bool:
    if m["reduction"] not in ("mean", "sum") or not isinstance(m["ignore_index"], int):
        return False
    h, w, target = example_value(m["h"]), example_value(m["w"]), example_value(m["target"])
    logits_in = example_value(normalized_args(m["loss"])["input"])
    if h is None or w is None or target is None or logits_in is None:
        return False
    if len(w.shape) != 2 or not same_size(h.shape[-1], w.shape[1]) or not h.dtype.is_floating_point:
        return False
    vocab = w.shape[0]
    rows = math.prod(h.shape[:-1])
    if not same_shape(logits_in.shape, (rows, vocab)) or not same_shape(target.shape, (rows,)):
        return False  # the chain must only fold leading dims into rows; class-index targets only
    if target.dtype not in (torch.int64, torch.int32):
        return False
    if "t_dim0" in m.bindings and {m["t_dim0"] % 2, m["t_dim1"] % 2} != {0, 1}:
        return False
    bias = m.get("bias")
    if bias is not None:
        b = example_value(bias)
        if not isinstance(bias, fx.Node) or b is None or not same_shape(b.shape, (vocab,)):
            return False
    for node in m.nodes:  # a cast in the chain may only go up to fp32
        if canonical_op(node) == "to" and normalized_args(node)["dtype"] is not torch.float32:
            return False
    return True


def _chunk_rows(options: FuseLinearCrossEntropyOptions, rows: Any, vocab: Any) -> int | None:
    if options.chunk_rows is not None:
        chunk = options.chunk_rows
    elif isinstance(vocab, int):
        chunk = max(1, int(options.chunk_mb * 2**20) // (vocab * 4))
    else:
        return None  # a symbolic vocabulary size: no chunk size to derive from chunk_mb
    # Clamp to the rows there are (a tidier graph), unless their number is symbolic (dynamic shapes).
    return min(chunk, rows) if isinstance(rows, int) else chunk


def _rewrite(gm: fx.GraphModule, anchor: fx.Node, options: FuseLinearCrossEntropyOptions) -> fx.Node | None:
    for m in iter_matches(PATTERN, anchor):
        if not _acceptable(m):
            continue
        # fp32 loss where the chain casts up, or where the graph's loss is fp32 anyway: autocast runs
        # cross_entropy in fp32 (a fuzzer's bf16 logits gave a bf16 loss where eager's was fp32)
        loss = example_value(anchor)
        upcast = any(canonical_op(n) in ("float", "to") for n in m.nodes) or (
            loss is not None and loss.dtype == torch.float32)
        rows, vocab = example_value(m["target"]).shape[0], example_value(m["w"]).shape[0]
        chunk_rows = _chunk_rows(options, rows, vocab)
        if chunk_rows is None:
            return None
        args = (m["h"], m["w"], m.get("bias"), m["target"], m["ignore_index"], m["reduction"], chunk_rows, upcast)
        return replace_with_call(gm, m, linear_cross_entropy, args)
    return None


@register_pass("fuse_linear_cross_entropy", "pre_grad", FuseLinearCrossEntropyOptions)
def fuse_linear_cross_entropy(
    gm: fx.GraphModule, options: FuseLinearCrossEntropyOptions, ctx: PassContext
) -> PassResult:
    """Replace output projection + cross-entropy with a chunked op that never holds the full logits."""
    n = rewrite_all(gm, {"cross_entropy"}, lambda g, node: _rewrite(g, node, options))
    return PassResult(changed=n > 0, summary=f"matched {n} linear+cross-entropy", counts={"matched": n})

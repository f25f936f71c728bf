"""cpu_attention: ``F.scaled_dot_product_attention`` on the CPU -> accelrun's C++ attention kernel.

Takes calls with no mask tensor (causal or full), or with a causal mask the graph computes from numbers
alone, boolean or additive, (T, T) to (B, 1, T, T) (``folded_mask_is_causal``: transformers' under
torch.compile, a user's ``tril``), fp32 or bf16 inputs, equal query and key
lengths and a head_dim the kernel handles (``fused.attention.supports``); any other call keeps ATen's.
The kernel reads its sizes at each call, so a sequence length that changes between calls (a symbol in
the graph; a user's own data without packing) is taken too, where no mask tensor is given.
A mask the graph is given as an input (a model that builds it outside its blocks: transformers' Falcon)
goes to ``cpu_attention_masked``, which sends each call to the kernel when the mask is the causal one and
to ATen's flash attention with the mask when it is not (``mask_problem`` says which masks it takes).
Keys and values repeated to the query heads' count (``x.repeat_interleave(group, dim=1)``, how
grouped-query attention is usually written) are taken before the repeat: the kernel reads each
key/value head once for its whole group and the graph no longer saves the repeated copies.
A call with ``dropout_p`` (and no mask tensor) goes to ``cpu_attention_dropout``: the kernel drops
probabilities by numbers drawn from (a seed, their index), again in the backward, so no mask is kept.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import fx, nn

from accelrun.compile.fused import attention as kernel
from accelrun.compile.passes.base import PassContext, PassOptions, PassResult, register_pass
from accelrun.compile.pattern import (
    constant_value,
    erase_dead,
    example_value,
    same_size,
    shape_but_length,
    static_shape,
)
from accelrun.compile.record import LEFT_TO_ATEN

SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_arguments(node: fx.Node) -> dict | None:
    """The call's arguments by name, defaults filled in; None if ``node`` is not an SDPA call."""
    if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
        return None
    args = dict(SDPA_DEFAULTS)
    args.update(zip(SDPA_PARAMS, node.args, strict=False))
    args.update(node.kwargs)
    return args


def unrepeated_heads(node: fx.Node, heads: int) -> fx.Node | None:
    """``x`` when ``node`` is ``x.repeat_interleave(heads // x's heads, dim=1)`` (method or function)."""
    is_repeat = (node.op == "call_method" and node.target == "repeat_interleave") or (
        node.op == "call_function" and node.target is torch.repeat_interleave
    )
    if not is_repeat or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source, shape = node.args[0], static_shape(node.args[0])
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if shape is None or len(shape) != 4 or not shape[1] or heads % shape[1] or dim not in (1, -3):
        return None
    return source if repeats == heads // shape[1] else None


# Largest mask (elements) evaluated at compile time to see whether it is the causal one: 64 MiB of bools.
MAX_FOLDED_MASK = 1 << 26


def folded_mask_is_causal(mask: fx.Node, seq: int) -> bool | None:
    """Whether ``mask``, when the graph computes it from numbers alone, is a causal mask over ``seq``
    queries and keys, boolean or additive, (T, T) or broadcast over batch and heads; None when its values
    are not known while compiling (an input, or computed from one). transformers builds a (B, 1, T, T)
    one from aranges when compiled, where it passes no mask and ``is_causal=True`` in eager; users write
    ``torch.ones(T, T, dtype=torch.bool).tril()`` or ``nn.Transformer.generate_square_subsequent_mask``."""
    value = constant_value(mask, MAX_FOLDED_MASK)
    if value is None:
        return None
    return isinstance(value, torch.Tensor) and 2 <= value.dim() <= 4 and kernel.mask_is_causal(value, seq)


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> torch.dtype | str | None:
    """The dtype of the attention call now given to the kernel, why it stays with ATen (a str), or None
    when ``node`` is no attention call."""
    args = sdpa_arguments(node)
    if args is None:
        return None
    drop = args["dropout_p"]
    if not isinstance(drop, (int, float)) or not 0.0 <= drop < 1.0:
        return "a dropout p not fixed when compiling, or of 1"
    if drop and args["attn_mask"] is not None:
        return "dropout with a mask"
    q, k, v = args["query"], args["key"], args["value"]
    shapes = [static_shape(t) or shape_but_length(t, 4, 2) for t in (q, k, v)]  # (B, H, S, D)
    if any(s is None for s in shapes) or not isinstance(args["is_causal"], bool):
        return "sizes or is_causal not fixed when compiling"
    mask, checked_at_run_time = args["attn_mask"], None
    if mask is not None:
        if args["is_causal"] or not isinstance(mask, fx.Node) or not same_size(shapes[0][-2], shapes[1][-2]):
            return "a mask with is_causal, or queries and keys of different lengths"  # (compared without a guard)
        # A mask over a length that changes between calls is computed at each call: its values are seen
        # when it runs (the causal one runs the kernel), as for a mask the graph is given.
        folded = folded_mask_is_causal(mask, shapes[0][-2]) if isinstance(shapes[0][-2], int) else None
        if folded is False:
            return mask_problem(example_value(mask), shapes[0]) or "a mask other than the causal one"
        if folded:
            args["is_causal"] = True  # the mask said no more than that
        elif (problem := mask_problem(example_value(mask), shapes[0])) is None:
            checked_at_run_time = mask  # its values are not known yet: whether it is causal is seen per call
        else:
            return problem
    if not isinstance(args["scale"], (float, int, type(None))):
        return "a scale not fixed when compiling"
    values = [example_value(t) for t in (q, k, v)]
    run_in = autocast_dtype(values, example_value(node))
    if run_in is not None:  # as autocast would: every input in the dtype it runs the attention in
        values = [_converted(t, run_in) for t in values]
    if (problem := kernel.supports(*values, threads=torch.get_num_threads())) is not None:
        return None if problem == kernel.NOT_ON_CPU else problem  # a GPU's attention: not this pass's to report
    if getattr(example_value(node), "dtype", None) != values[0].dtype:
        return "autocast runs it in another dtype than its inputs'"
    group = shapes[0][1] // shapes[1][1]
    if group > 1 and not args["enable_gqa"]:
        return "fewer key/value heads than query heads without enable_gqa"  # SDPA itself refuses these
    if group == 1:  # perhaps repeated by hand for a plain SDPA call: take k and v before the repeat
        k_src, v_src = unrepeated_heads(k, shapes[0][1]), unrepeated_heads(v, shapes[0][1])
        if k_src is not None and v_src is not None and static_shape(k_src) == static_shape(v_src):
            k, v = k_src, v_src
    scale = float(args["scale"]) if args["scale"] is not None else 1.0 / math.sqrt(shapes[0][-1])
    with gm.graph.inserting_before(node):
        if run_in is not None:
            q, k, v = (_cast(gm, t, run_in) for t in (q, k, v))
        if checked_at_run_time is not None:
            new = gm.graph.call_function(kernel.attention_masked, (q, k, v, checked_at_run_time, scale))
        elif drop:
            new = gm.graph.call_function(kernel.attention_dropout, (q, k, v, scale, args["is_causal"], float(drop)))
        else:
            new = gm.graph.call_function(kernel.attention, (q, k, v, scale, args["is_causal"]))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    erase_dead(gm.graph, [n for n in (args["key"], args["value"], mask) if isinstance(n, fx.Node)])
    return values[0].dtype


def autocast_dtype(inputs: list, output: object) -> torch.dtype | None:
    """The dtype autocast runs an attention call in where its inputs are not all of it, or None. Under
    bf16 autocast transformers' RoPE models give fp32 queries and keys (rotated in fp32) and bf16 values:
    autocast casts all three to bf16, and so does this pass (they had stayed with ATen, "dtype
    torch.float32", at 1.10x eager against 1.30x in fp32: a new user's Qwen2)."""
    run_in = getattr(output, "dtype", None)
    if run_in not in kernel.ELEMENT_TYPES or any(t is None or not t.dtype.is_floating_point for t in inputs):
        return None
    return run_in if any(t.dtype != run_in for t in inputs) else None


def _cast(gm: fx.GraphModule, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    value = example_value(node)
    if value is None or value.dtype == dtype:
        return node
    cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": dtype})  # (with its gradient)
    cast.meta["example_value"] = _converted(value, dtype)
    return cast


def _converted(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value`` in ``dtype``; a fake value under its own fake mode (the one Dynamo made it in)."""
    with getattr(value, "fake_mode", None) or contextlib.nullcontext():
        return value.to(dtype)


def mask_problem(mask: object, query_shape: tuple[int, ...]) -> str | None:
    """Why ``cpu_attention_masked`` cannot take this mask for queries of ``query_shape`` (B, H, S, D), or None:
    it must be boolean or additive (floating), need no gradient, and broadcast to (B, H, S, S)."""
    if not isinstance(mask, torch.Tensor):
        return "no example value"
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"a {mask.dtype} mask"
    if mask.requires_grad:
        return "a mask that needs a gradient (a learned bias)"
    B, H, S, _ = query_shape  # S may be a symbol (a length that changes): compared without a guard
    # (ATen's attention, where a mask other than the causal one runs, takes 2 or 4 axes)
    if mask.dim() not in (2, 4) or not all(same_size(m, S) for m in mask.shape[-2:]) or not all(
            same_size(m, 1) or same_size(m, n) for m, n in zip(mask.shape[:-2], (B, H), strict=False)):  # fmt: skip
        return f"mask of shape {list(mask.shape)} for {B} x {H} x {S} x {S} scores"
    return None


def build_kernel_early(module: nn.Module) -> None:
    """Start the kernel's build before Dynamo traces ``module``, for the dtype its attention will most
    likely run in, when one of its modules calls ``F.scaled_dot_product_attention`` (``_calls_sdpa``) and
    its parameters are on the CPU. The pass starts it once tracing has found the calls; from here g++ is done
    0.5 s sooner, which on the debug Llama's cold step was time its blocks' first forward waited. A
    wrong guess costs one background build, once per machine (``cpp_build``'s cache)."""
    param = next((p for p in module.parameters() if p.is_floating_point()), None)
    if param is None or param.device.type != "cpu" or kernel.find_compiler() is None:
        return
    calls_sdpa = any(_calls_sdpa(m) for m in module.modules())
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else param.dtype
    if calls_sdpa and dtype in kernel.ELEMENT_TYPES:
        kernel.build_in_background(dtype)


def _calls_sdpa(module: nn.Module) -> bool:
    """The module's forward names ``scaled_dot_product_attention``, or it is a transformers module whose
    config picks SDPA (its attention calls it through a table of attention functions)."""
    code = getattr(type(module).forward, "__code__", None)  # None: a forward that is not Python code
    if code is not None and "scaled_dot_product_attention" in code.co_names:
        return True
    return getattr(getattr(module, "config", None), "_attn_implementation", None) == "sdpa"


@register_pass("cpu_attention", "pre_grad", PassOptions)
def cpu_attention(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Run CPU attention calls through accelrun's C++ kernel (its build starts now, beside compilation)."""
    outcomes = [d for node in list(gm.graph.nodes) if (d := _rewrite(gm, node)) is not None]
    dtypes = [d for d in outcomes if isinstance(d, torch.dtype)]
    left = Counter(d for d in outcomes if isinstance(d, str))
    n = len(dtypes)
    for dtype in set(dtypes):
        kernel.build_in_background(dtype)
    if n:
        gm.graph.lint()
        gm.recompile()
    summary = f"{n} attention calls to the C++ kernel"
    if masked := len(gm.graph.find_nodes(op="call_function", target=kernel.attention_masked)):
        summary += f" ({masked} given a mask, looked at when they run: the causal one runs the kernel)"
    if left:  # never silent: why the others stay with ATen
        summary += "; left to ATen: " + ", ".join(f"{why} ({count})" for why, count in left.items())
    # Each reason is a count of its own, which the run's report lists (CompileRecord.attention_left_to_aten).
    return PassResult(changed=n > 0, summary=summary,
                      counts={"matched": n, **{f"{LEFT_TO_ATEN}{why}": count for why, count in left.items()}})

"""Scaled dot-product attention on CPUs through accelrun's own kernel (``attention_cpu.cpp``).

``torch.ops.accelrun.cpu_attention`` and its backward are custom ops with a registered autograd
formula, so AOTAutograd puts them in the forward and backward graphs as they are. Against ATen's CPU
flash attention (what eager and Inductor run) the kernel keeps a query block's whole score rows in
cache instead of rescaling online, register-blocks its products, and takes grouped-query K/V without
repeating them: forward 1.9x and backward 1.8x faster on the debug Llama's shape (16x6x256x32, fp32,
causal; ``python bench/attention_cpu.py``). It saves q, k, v, the output and the per-row log-sum-exp.

The library is compiled by g++ once per machine and dtype (``cpp_build``'s on-disk cache); ``supports`` says
which calls it takes (the ``cpu_attention`` pass asks it), everything else stays with ATen.
"""

from __future__ import annotations

import ctypes
import warnings
import weakref
from pathlib import Path

import torch

from accelrun.compile.codegen.cpp_build import find_compiler
from accelrun.compile.codegen.exp_poly import EXP_CORE
from accelrun.compile.fused import dropout
from accelrun.compile.fused.kernel_library import ELEMENT_TYPES, PerDtypeLibrary, element_prelude
from accelrun.compile.pattern import same_shape, same_size
from accelrun.op_source_lookup import known_to_inspect

known_to_inspect(__name__)  # before the ops below: torch.library looks up their source lines

SOURCE = Path(__file__).with_name("attention_cpu.cpp")
MAX_HEAD_DIM = 256  # the kernel's row buffer (attention_cpu.cpp's MAX_HEAD_DIM)
NOT_ON_CPU = "not on the CPU"


def shape_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernel cannot compute these (B, H, S, D) inputs at all, or None (the ops check it too)."""
    if not (q.dtype == k.dtype == v.dtype):
        return f"queries, keys and values of dtypes {q.dtype}, {k.dtype}, {v.dtype} (one dtype for all three)"
    if q.dtype not in ELEMENT_TYPES:
        return f"dtype {q.dtype} (fp32 and bf16 only)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "not (batch, heads, sequence, head_dim)"
    (B, Hq, S, D), (Bk, Hkv, Sk, Dk) = q.shape, k.shape
    if not all(isinstance(n, int) for n in (B, Hq, D, Bk, Hkv, Dk)):
        return "batch, heads or head_dim not fixed when compiling"
    # A sequence length that changes between calls is a symbol: compared without a guard on its value.
    if Bk != B or Dk != D:
        return "q and k disagree on batch or head_dim"
    if not same_shape(v.shape, k.shape):
        # (a fuzzer's keys and values of one length per call, traced as two symbols, read "disagree on batch")
        fixed_differ = any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(k.shape, v.shape, strict=True))
        if fixed_differ or all(isinstance(n, int) for n in (*k.shape, *v.shape)):  # (a head_dim of v's own, say)
            return f"k and v of shapes {tuple(k.shape)} and {tuple(v.shape)} (one shape for both)"
        return (f"k's and v's sizes {tuple(k.shape)} and {tuple(v.shape)} are symbols not known equal when compiling "
                "(a length that changes between calls, traced once for each)")
    if not same_size(Sk, S):
        return "queries and keys of different lengths"
    if Hkv == 0 or Hq % Hkv:
        return "query heads are not a multiple of key/value heads"
    if D <= 0 or D % 16 or D > MAX_HEAD_DIM:
        return f"head_dim {D} (the kernel needs a multiple of 16 up to {MAX_HEAD_DIM})"
    return None


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threads: int = 1) -> str | None:
    """Why the pass should leave these (B, H, S, D) inputs to ATen, or None when the kernel takes them.
    ``threads``: the kernel runs one (batch, key/value head) per thread at a time, so fewer of those
    than threads would leave threads idle where ATen's kernel splits the sequence too."""
    if find_compiler() is None:
        return "no C++ compiler"
    if any(t.device.type != "cpu" for t in (q, k, v)):
        return NOT_ON_CPU
    problem = shape_problem(q, k, v)
    if problem is None and q.shape[0] * k.shape[1] < threads:
        problem = f"{q.shape[0] * k.shape[1]} (batch, key/value head) pairs for {threads} threads"
    return problem


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    problem = shape_problem(q, k, v)
    if problem is not None:
        raise ValueError(f"accelrun::cpu_attention cannot take these inputs: {problem}")


def _source(dtype: torch.dtype) -> str:
    return element_prelude(dtype) + f"{dropout.cpp_defines()}{EXP_CORE}" + SOURCE.read_text()


def _declare(lib: ctypes.CDLL) -> None:
    i64p, f32p, vp = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_float), ctypes.c_void_p
    # ..., scale, causal, dropout's seed and p (0: none), threads
    tail = [ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_int]
    lib.attention_forward.argtypes = [vp, vp, vp, vp, f32p, i64p, i64p, *tail]
    lib.attention_backward.argtypes = [vp, vp, vp, vp, vp, f32p, vp, vp, vp, i64p, i64p, *tail]
    lib.attention_keep_factors.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_float, f32p]


# The kernel's library per dtype; None from _library: it could not be built (the ops then compute with ATen).
LIBRARY = PerDtypeLibrary("CPU attention kernel", "attention runs in ATen", _source, _declare)
_library = LIBRARY.get
# Called by the pass: g++ runs beside the rest of compilation; the first call waits for it if it is not done.
build_in_background = LIBRARY.build_in_background


_aten_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_aten_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _repeated(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k.repeat_interleave(heads // k.shape[1], 1) if heads != k.shape[1] else k


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _bshd_strides(t: torch.Tensor) -> list[int]:
    """(batch, sequence, head) strides of a (B, H, S, D) tensor: the kernel's order."""
    return [t.stride(0), t.stride(2), t.stride(1)]


def _bshd_empty(like: torch.Tensor, heads: int) -> torch.Tensor:
    """A new (B, heads, S, D) tensor laid out as contiguous (B, S, heads, D), as the kernel writes."""
    B, _, S, D = like.shape
    return like.new_empty(B, S, heads, D).transpose(1, 2)


def _shape(q: torch.Tensor, k: torch.Tensor) -> ctypes.Array:
    B, Hq, S, D = q.shape
    return (ctypes.c_int64 * 5)(B, S, Hq, k.shape[1], D)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


@torch.library.custom_op("accelrun::cpu_attention", mutates_args=(), device_types="cpu")
def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse): softmax(q k^T * scale [causal]) v for q (B, Hq, S, D) and k, v (B, Hkv, S, D)."""
    return _kernel_forward(q, k, v, scale, causal)


def _kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, seed: int = 0,
                    drop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    _check(q, k, v)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    out = _bshd_empty(q, q.shape[1])
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    lib = _library(q.dtype)
    if lib is None:  # no kernel: ATen's flash attention (with dropout, the reference), in the kernel's layout
        return _aten_forward(q, k, v, scale, causal) if drop == 0 else _reference_forward(q, k, v, scale, causal,
                                                                                          seed, drop)  # fmt: skip
    strides = (ctypes.c_int64 * 9)(*_bshd_strides(q), *_bshd_strides(k), *_bshd_strides(v))
    lib.attention_forward(_ptr(q), _ptr(k), _ptr(v), _ptr(out),
                                 ctypes.cast(lse.data_ptr(), ctypes.POINTER(ctypes.c_float)), _shape(q, k), strides,
                                 scale, int(causal), seed, drop, torch.get_num_threads())  # fmt: skip
    return out, lse


@cpu_attention.register_fake
def _(q, k, v, scale, causal):
    return _bshd_empty(q, q.shape[1]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("accelrun::cpu_attention_backward", mutates_args=(), device_types="cpu")
def cpu_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of ``cpu_attention``, from the saved out and lse."""
    return _kernel_backward(grad_out, q, k, v, out, lse, scale, causal)


def _kernel_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, scale: float, causal: bool, seed: int = 0, drop: float = 0.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    _check(q, k, v)
    if grad_out.shape != q.shape or out.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError("accelrun::cpu_attention_backward: grad_out, out and lse do not match q's shape")
    q, k, v, grad_out = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(grad_out.to(q.dtype))
    if not out.transpose(1, 2).is_contiguous():
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # the kernel reads it as contiguous (B, S, H, D)
    lse = lse.contiguous()
    dq, dk, dv = _bshd_empty(q, q.shape[1]), _bshd_empty(k, k.shape[1]), _bshd_empty(v, v.shape[1])
    lib = _library(q.dtype)
    if lib is None:  # no kernel: ATen's flash backward, or the reference's (the forward was theirs too)
        if drop != 0:
            return _reference_backward(grad_out, q, k, v, scale, causal, seed, drop)
        return _aten_backward(grad_out, q, k, v, out, lse, scale, causal)
    strides = (ctypes.c_int64 * 12)(*_bshd_strides(q), *_bshd_strides(k), *_bshd_strides(v), *_bshd_strides(grad_out))
    lib.attention_backward(_ptr(grad_out), _ptr(q), _ptr(k), _ptr(v), _ptr(out),
                                  ctypes.cast(lse.data_ptr(), ctypes.POINTER(ctypes.c_float)), _ptr(dq), _ptr(dk),
                                  _ptr(dv), _shape(q, k), strides, scale, int(causal), seed, drop,
                                  torch.get_num_threads())  # fmt: skip
    return dq, dk, dv


@cpu_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, scale, causal):
    return _bshd_empty(q, q.shape[1]), _bshd_empty(k, k.shape[1]), _bshd_empty(v, v.shape[1])


def _aten_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse) from ATen's flash attention (eager's kernel), in the kernel's layout; K/V repeated to
    q's heads."""
    out, lse = _bshd_empty(q, q.shape[1]), q.new_empty(q.shape[:3], dtype=torch.float32)
    aten_out, aten_lse = _aten_flash(q, _repeated(k, q.shape[1]), _repeated(v, q.shape[1]), 0.0, causal,
                                     attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)  # fmt: skip
    return out.copy_(aten_out), lse.copy_(aten_lse)


def _aten_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of ``_aten_forward`` from ATen's flash backward, in the kernel's layout; the repeated
    K/V's gradients summed per group."""
    heads, kv_heads = q.shape[1], k.shape[1]
    gq, gk, gv = _aten_flash_backward(_unit_last(grad_out.to(q.dtype)).contiguous(), q, _repeated(k, heads),
                                      _repeated(v, heads), out, lse.contiguous(), 0.0, causal,
                                      attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)  # fmt: skip
    dq, dk, dv = _bshd_empty(q, heads), _bshd_empty(k, kv_heads), _bshd_empty(v, kv_heads)
    dq.copy_(gq)
    dk.copy_(gk.unflatten(1, (kv_heads, heads // kv_heads)).sum(2))
    dv.copy_(gv.unflatten(1, (kv_heads, heads // kv_heads)).sum(2))
    return dq, dk, dv


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mark_non_differentiable(lse)  # a by-product for the backward: no gradient flows through it
    ctx.scale, ctx.causal = scale, causal


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.accelrun.cpu_attention_backward(grad_out, q, k, v, out, lse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


cpu_attention.register_autograd(_backward, setup_context=_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """softmax(q k^T * scale [causal]) v through the C++ kernel; k and v may hold fewer heads than q
    (grouped-query attention, q's heads in groups of Hq / Hkv)."""
    return torch.ops.accelrun.cpu_attention(q, k, v, scale, causal)[0]


# -- attention with dropout on its probabilities ----------------------------------------------------
# SDPA with dropout_p (nanoGPT trains so) drops probabilities after the softmax. The kernel draws each
# one's number from (a seed, its index in the [B, Hq, S, S] probabilities) with fused/dropout.py's
# generator, in the forward and again in the backward, so no mask is stored; the seed is one draw from
# torch's generator per call. ``_reference`` computes the same attention with torch ops (the library
# cannot be built: the ops use it; tests compare the kernel with it).


def _reference_probabilities(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, seed: int, drop: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(softmax probabilities, lse, keep factor: 0 or 1 / (1 - drop)) in fp32, k repeated to q's heads."""
    B, H, S, _ = q.shape
    scores = q.float() @ _repeated(k, H).float().transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    keep = dropout.uniform_reference(torch.tensor(seed, device=q.device), [B, H, S, S]) >= drop
    return torch.exp(scores - lse[..., None]), lse, keep * (1.0 / (1.0 - drop))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, seed: int,
               drop: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out (B, Hq, S, D), lse) in fp32, differentiable in q, k and v."""
    probs, lse, factor = _reference_probabilities(q, k, scale, causal, seed, drop)
    return (probs * factor) @ _repeated(v, q.shape[1]).float(), lse


def _reference_forward(q, k, v, scale, causal, seed, drop) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _reference(q, k, v, scale, causal, seed, drop)
    return _bshd_empty(q, q.shape[1]).copy_(out), lse.contiguous()


def _reference_backward(grad_out, q, k, v, scale, causal, seed, drop) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of ``_reference`` written out (a custom op's body runs below autograd): dV = P'^T dO,
    dP = (dO V^T) * factor, dS = P (dP - rowsum(P dP)); P' the dropped probabilities."""
    heads, kv_heads = q.shape[1], k.shape[1]
    probs, _, factor = _reference_probabilities(q, k, scale, causal, seed, drop)
    g = grad_out.float()
    dv = (probs * factor).transpose(-1, -2) @ g
    dp = (g @ _repeated(v, heads).float().transpose(-1, -2)) * factor
    ds = probs * (dp - (probs * dp).sum(-1, keepdim=True))
    dq = ds @ _repeated(k, heads).float() * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale
    grouped = (dk, dv) if heads == kv_heads else (t.unflatten(1, (kv_heads, heads // kv_heads)).sum(2) for t in (dk, dv))
    return tuple(_bshd_empty(t, t.shape[1]).copy_(d) for t, d in zip((q, k, v), (dq, *grouped), strict=True))


@torch.library.custom_op("accelrun::cpu_attention_dropout", mutates_args=(), device_types="cpu")
def cpu_attention_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seed: torch.Tensor, scale: float,
                          causal: bool, p: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse) of ``cpu_attention`` with dropout at rate ``p`` on the probabilities, drawn from ``seed``."""
    return _kernel_forward(q, k, v, scale, causal, int(seed), p)


@cpu_attention_dropout.register_fake
def _(q, k, v, seed, scale, causal, p):
    return _bshd_empty(q, q.shape[1]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("accelrun::cpu_attention_dropout_backward", mutates_args=(), device_types="cpu")
def cpu_attention_dropout_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   out: torch.Tensor, lse: torch.Tensor, seed: torch.Tensor, scale: float,
                                   causal: bool, p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of ``cpu_attention_dropout``: the same numbers drawn again from the seed."""
    return _kernel_backward(grad_out, q, k, v, out, lse, scale, causal, int(seed), p)


@cpu_attention_dropout_backward.register_fake
def _(grad_out, q, k, v, out, lse, seed, scale, causal, p):
    return _bshd_empty(q, q.shape[1]), _bshd_empty(k, k.shape[1]), _bshd_empty(v, v.shape[1])


def _setup_dropout_context(ctx, inputs, output) -> None:
    q, k, v, seed, scale, causal, p = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed)
    ctx.mark_non_differentiable(lse)
    ctx.scale, ctx.causal, ctx.p = scale, causal, p


def _dropout_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.accelrun.cpu_attention_dropout_backward(grad_out, q, k, v, out, lse, seed, ctx.scale,
                                                                   ctx.causal, ctx.p)  # fmt: skip
    return dq, dk, dv, None, None, None, None


cpu_attention_dropout.register_autograd(_dropout_backward, setup_context=_setup_dropout_context)

# The ops that draw dropout's numbers with fused/dropout.py's generator instead of ATen's (masks unlike
# eager's): the compile record counts them per graph.
DRAWS_DROPOUT = frozenset({torch.ops.accelrun.dropout_uniform.default,
                           torch.ops.accelrun.cpu_attention_dropout.default})


def attention_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, p: float
                      ) -> torch.Tensor:  # fmt: skip
    """``attention`` with dropout at rate ``p`` on the probabilities (SDPA's ``dropout_p``), its seed one
    draw from torch's generator."""
    seed = torch.randint(0, dropout.SEED_HIGH, (), dtype=torch.int64, device=q.device)
    return torch.ops.accelrun.cpu_attention_dropout(q, k, v, seed, scale, causal, p)[0]


# -- attention given a mask tensor ------------------------------------------------------------------
# A model that builds its causal mask outside the compiled graph (transformers' Falcon always does, so
# that ALiBi can be added to it) passes it in as a tensor, whose values are unknown when compiling.
# ``cpu_attention_masked`` looks at the mask when it runs: the causal one goes to the kernel with its
# causal flag (the same result as ``cpu_attention``), any other (padding, sliding windows, a bias) to
# ATen's flash attention with the mask, which is what eager PyTorch runs for such a call.


class _LastMaskAnswer:
    """Whether the last mask asked about was causal, kept while that same tensor is alive and unchanged:
    a model passes one mask to every layer, and the backward reads it again."""

    def __init__(self) -> None:
        self.ref: weakref.ref | None = None
        self.key: tuple = ()
        self.causal = False

    def lookup(self, mask: torch.Tensor) -> bool | None:
        if self.ref is not None and self.ref() is mask and self.key == (mask._version, mask.shape, mask.stride()):
            return self.causal
        return None

    def keep(self, mask: torch.Tensor, causal: bool) -> bool:
        self.ref, self.key, self.causal = weakref.ref(mask), (mask._version, mask.shape, mask.stride()), causal
        return causal


_last_mask = _LastMaskAnswer()
masked_calls = {"kernel": 0, "aten": 0}  # forward calls of cpu_attention_masked by where they ran (tests, report)


def mask_is_causal(mask: torch.Tensor, seq: int) -> bool:
    """Whether ``mask``, broadcast over (batch, heads, seq, seq), allows exactly each query's keys up to
    itself: boolean True on and below the diagonal, or additive 0 there and -inf (or the dtype's lowest
    value) above it."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (seq, seq):
        return False
    known = _last_mask.lookup(mask)
    if known is not None:
        return known
    # Broadcast axes (stride 0, or size 1) hold one matrix: it is checked once, not once per batch row.
    distinct = mask[tuple(0 if mask.stride(d) == 0 or mask.shape[d] == 1 else slice(None)
                          for d in range(mask.dim() - 2))]  # fmt: skip
    lower = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril().expand(distinct.shape)
    if mask.dtype == torch.bool:
        causal = torch.equal(distinct, lower)
    elif mask.dtype.is_floating_point:
        blocked = (distinct == float("-inf")) | (distinct == torch.finfo(mask.dtype).min)
        causal = torch.equal(distinct == 0, lower) and torch.equal(blocked, ~lower)
    else:
        causal = False
    return _last_mask.keep(mask, causal)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask as ATen's flash attention takes it: added to the scores (SDPA converts a boolean one so)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


@torch.library.custom_op("accelrun::cpu_attention_masked", mutates_args=(), device_types="cpu")
def cpu_attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse) of softmax(q k^T * scale + mask) v: the kernel's causal attention when ``mask`` is the
    causal mask (``mask_is_causal``), ATen's flash attention with the mask otherwise."""
    if mask_is_causal(mask, q.shape[2]):
        masked_calls["kernel"] += 1
        return _kernel_forward(q, k, v, scale, True)
    masked_calls["aten"] += 1
    if masked_calls["aten"] == 1:  # once a process: the first such call, not every one
        warnings.warn("accelrun: an attention mask other than the causal one (padding, a window, a bias): such "
                      "calls run ATen's flash attention with the mask, as eager does, not accelrun's kernel",
                      stacklevel=2)  # fmt: skip
    _check(q, k, v)
    return _aten_forward(q, k, v, scale, False, mask)


@cpu_attention_masked.register_fake
def _(q, k, v, mask, scale):
    return _bshd_empty(q, q.shape[1]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("accelrun::cpu_attention_masked_backward", mutates_args=(), device_types="cpu")
def cpu_attention_masked_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor, scale: float
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of ``cpu_attention_masked``, where its forward ran."""
    if mask_is_causal(mask, q.shape[2]):
        return _kernel_backward(grad_out, q, k, v, out, lse, scale, True)
    _check(q, k, v)
    return _aten_backward(grad_out, q, k, v, out, lse, scale, False, mask)


@cpu_attention_masked_backward.register_fake
def _(grad_out, q, k, v, out, lse, mask, scale):
    return _bshd_empty(q, q.shape[1]), _bshd_empty(k, k.shape[1]), _bshd_empty(v, v.shape[1])


def _setup_masked_context(ctx, inputs, output) -> None:
    q, k, v, mask, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.mark_non_differentiable(lse)
    ctx.scale = scale


def _masked_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.accelrun.cpu_attention_masked_backward(grad_out, q, k, v, out, lse, mask, ctx.scale)
    return dq, dk, dv, None, None


cpu_attention_masked.register_autograd(_masked_backward, setup_context=_setup_masked_context)


def attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                     ) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale + mask) v for a mask that needs no gradient (boolean: True = attend); the
    C++ kernel runs it when the mask is the causal one."""
    return torch.ops.accelrun.cpu_attention_masked(q, k, v, mask, scale)[0]

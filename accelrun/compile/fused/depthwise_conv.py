"""Depthwise 1-d convolutions on CPUs through accelrun's own kernel (``depthwise_conv_cpu.cpp``).

A depthwise ``Conv1d`` (``groups`` = channels, one filter of K taps per channel: a ConvNeXt-style
mixer, Mamba's and Hyena's short causal convolutions) does K multiply-adds per element, yet ATen runs it
through oneDNN's general convolution, and so do eager PyTorch and Inductor. The kernel here computes a
row as K shifted multiply-adds over a buffer in L1: on this project's 2-core AVX-512 machine 1.3-3.2x
oneDNN's forward and 3.2-9.0x its backward (0.80 against 0.32 ms forward at (16, 256, 256) K 3; 29.5
against 5.4 ms backward at Mamba-130m's (4, 1536, 1024) K 4; ``python bench/depthwise_conv.py``).

``torch.ops.accelrun.depthwise_conv1d`` and its backward are custom ops: the ``cpu_depthwise_conv``
pass puts them in the forward and backward graphs in place of ATen's ``convolution`` and
``convolution_backward`` where ``problem`` finds nothing against it. fp32 and bf16 (computed in fp32,
rounded once); stride 1, dilation 1, zero padding; any length, read at each call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from accelrun.compile.codegen.cpp_build import find_compiler
from accelrun.compile.fused.kernel_library import ELEMENT_TYPES, PerDtypeLibrary, element_prelude
from accelrun.op_source_lookup import known_to_inspect

known_to_inspect(__name__)  # before the ops below: torch.library looks up their source lines

SOURCE = Path(__file__).with_name("depthwise_conv_cpu.cpp")
NOT_ON_CPU = "not on the CPU"
NOT_DEPTHWISE_1D = "not a depthwise 1-d convolution"  # (with NOT_ON_CPU) no call for this kernel: not reported


def _source(dtype: torch.dtype) -> str:
    return element_prelude(dtype) + SOURCE.read_text()


def _declare(lib: ctypes.CDLL) -> None:
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.depthwise_forward.argtypes = [vp, vp, vp, vp, i64, i64, i64, i64, i64, ctypes.c_int]
    lib.depthwise_backward.argtypes = [vp, vp, vp, vp, vp, vp, i64, i64, i64, i64, i64, ctypes.c_int]


LIBRARY = PerDtypeLibrary("depthwise convolution kernel", "depthwise convolutions run in ATen", _source, _declare)


def problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: list, padding: list,
            dilation: list, transposed: bool, output_padding: list, groups: int) -> str | None:  # fmt: skip
    """Why the kernel does not compute ATen's ``convolution`` with these arguments (``NOT_ON_CPU``,
    ``NOT_DEPTHWISE_1D``: a call of another kind), or None when it does."""
    if x.device.type != "cpu":
        return NOT_ON_CPU
    if x.dim() != 3 or weight.dim() != 3:
        return NOT_DEPTHWISE_1D
    C, one, K = weight.shape
    if not all(isinstance(n, int) for n in (C, one, K, x.shape[1], groups, *padding)):
        return "channels, taps or padding not fixed when compiling"
    if one != 1 or groups != C or x.shape[1] != C:
        return NOT_DEPTHWISE_1D
    if find_compiler() is None:
        return "no C++ compiler"
    if transposed or list(stride) != [1] or list(dilation) != [1] or any(output_padding):
        return "a stride, dilation or transposed convolution"
    if x.dtype not in ELEMENT_TYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"dtype {x.dtype} (fp32 and bf16 only, the same for input, weight and bias)"
    return None


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: int,
           grad_out: torch.Tensor | None = None) -> None:  # fmt: skip
    """The ops' own arguments as the kernel reads them (the pass takes only calls that pass): a
    mismatch would read past a buffer, so it is an error."""
    why = None
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[1] != 1 or weight.shape[0] != x.shape[1]:
        why = f"x {tuple(x.shape)} and weight {tuple(weight.shape)} are not (B, C, T) and (C, 1, K)"
    elif bias is not None and tuple(bias.shape) != (weight.shape[0],):
        why = f"bias {tuple(bias.shape)} is not (C,) = ({weight.shape[0]},)"
    elif x.dtype not in ELEMENT_TYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        why = "x, weight and bias must share one dtype, fp32 or bf16"
    elif padding < 0 or _out_length(x, weight, padding) < 1:
        why = f"padding {padding} leaves no output for length {x.shape[2]} and {weight.shape[2]} taps"
    elif grad_out is not None and tuple(grad_out.shape) != (*x.shape[:2], _out_length(x, weight, padding)):
        why = f"grad_out {tuple(grad_out.shape)} is not the output's shape"
    if why is not None:
        raise ValueError(f"accelrun::depthwise_conv1d: {why}")


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _out_length(x: torch.Tensor, weight: torch.Tensor, padding: int) -> int:
    return x.shape[2] + 2 * padding - weight.shape[2] + 1


def _aten_args(padding: int, channels: int) -> tuple:
    return [1], [padding], [1], False, [0], channels


@torch.library.custom_op("accelrun::depthwise_conv1d", mutates_args=(), device_types="cpu")
def depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding: int) -> torch.Tensor:
    """ATen's ``convolution(x, weight, bias, [1], [padding], [1], False, [0], C)`` for x (B, C, T) and
    weight (C, 1, K): one filter per channel."""
    _check(x, weight, bias, padding)
    lib = LIBRARY.get(x.dtype)
    if lib is None:
        return torch.ops.aten.convolution.default(x, weight, bias, *_aten_args(padding, weight.shape[0]))
    B, C, T = x.shape
    x, weight = x.contiguous(), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = x.new_empty(B, C, _out_length(x, weight, padding))
    lib.depthwise_forward(_ptr(x), _ptr(weight), _ptr(bias), _ptr(y), B, C, T, weight.shape[2], padding,
                          torch.get_num_threads())  # fmt: skip
    return y


@depthwise_conv1d.register_fake
def _(x, weight, bias, padding):
    return x.new_empty(x.shape[0], x.shape[1], _out_length(x, weight, padding))


@torch.library.custom_op("accelrun::depthwise_conv1d_backward", mutates_args=(), device_types="cpu")
def depthwise_conv1d_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, padding: int,
                              input_grad: bool, weight_grad: bool, bias_grad: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(grad x, grad weight, grad bias) of ``depthwise_conv1d``; one not asked for is an empty tensor."""
    _check(x, weight, None, padding, grad_out)
    lib = LIBRARY.get(x.dtype)
    wanted = [input_grad, weight_grad, bias_grad]
    grad_out = grad_out.to(x.dtype)  # the gradients are in x's and the weight's dtype, as the fake says
    if lib is None:
        grads = torch.ops.aten.convolution_backward.default(grad_out, x, weight, [weight.shape[0]],
                                                            *_aten_args(padding, weight.shape[0]), wanted)
        return tuple(g if g is not None else x.new_empty(0) for g in grads)  # type: ignore[return-value]
    B, C, T = x.shape
    grad_out, x, weight = grad_out.contiguous(), x.contiguous(), weight.contiguous()
    gx, gw, gb = _empty_grads(x, weight, *wanted)
    lib.depthwise_backward(_ptr(grad_out), _ptr(x), _ptr(weight), _ptr(gx if input_grad else None),
                           _ptr(gw if weight_grad else None), _ptr(gb if bias_grad else None), B, C, T,
                           weight.shape[2], padding, torch.get_num_threads())  # fmt: skip
    return gx, gw, gb


def _empty_grads(x: torch.Tensor, weight: torch.Tensor, input_grad: bool, weight_grad: bool, bias_grad: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return (x.new_empty(x.shape) if input_grad else x.new_empty(0),
            weight.new_empty(weight.shape) if weight_grad else weight.new_empty(0),
            weight.new_empty(weight.shape[0]) if bias_grad else weight.new_empty(0))  # fmt: skip


@depthwise_conv1d_backward.register_fake
def _(grad_out, x, weight, padding, input_grad, weight_grad, bias_grad):
    return _empty_grads(x, weight, input_grad, weight_grad, bias_grad)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, padding = inputs
    ctx.save_for_backward(x, weight)
    ctx.padding, ctx.has_bias = padding, bias is not None


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    gx, gw, gb = torch.ops.accelrun.depthwise_conv1d_backward(
        grad_out, x, weight, ctx.padding, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
        ctx.has_bias and ctx.needs_input_grad[2])  # fmt: skip
    return (gx if ctx.needs_input_grad[0] else None, gw if ctx.needs_input_grad[1] else None,
            gb if ctx.has_bias and ctx.needs_input_grad[2] else None, None)  # fmt: skip


depthwise_conv1d.register_autograd(_backward, setup_context=_setup_context)

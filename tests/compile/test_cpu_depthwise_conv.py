"""Depthwise 1-d convolutions on the CPU run accelrun's kernel (fused/depthwise_conv.py): the ops
against ATen's convolution and its backward, and the cpu_depthwise_conv pass in models written the way
users write them (a conv mixer, Mamba's short causal convolution), at eager's losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.fused import depthwise_conv as kernel
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import resolve_passes
from tests.compile.test_user_models import _compiled_beside_eager
from tests.compile.user_models import ConvMixer, ShortConvLM

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}
# bf16 gradients sum a whole batch of rounded products: judged against the largest value
GRAD_TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-4}, torch.bfloat16: {"rtol": 2e-2, "atol": 1e-1}}


def _aten(x, w, b, padding):
    return F.conv1d(x, w, b, padding=padding, groups=w.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "C", "T", "K", "padding"), [
    (2, 8, 17, 3, 2),  # a conv mixer's causal convolution, before its output is cut to T
    (3, 5, 9, 4, 3),  # Mamba's (kernel 4, padding 3)
    (2, 4, 6, 5, 0),  # no padding: shorter output
    (1, 3, 4, 7, 3),  # more taps than the input is long
    (2, 4, 3, 2, 5),  # more padding than taps
    (2, 6, 33, 1, 0),  # one tap: a per-channel scale
])  # fmt: skip
def test_the_kernel_equals_atens_convolution_and_its_gradients(dtype, B, C, T, K, padding):
    gen = torch.Generator().manual_seed(B * 100 + K)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype).requires_grad_() for s in ((B, C, T), (C, 1, K), (C,)))
    y = kernel.depthwise_conv1d(x, w, b, padding)
    expected = _aten(x, w, b, padding)
    torch.testing.assert_close(y, expected, **TOL[dtype])
    grad = torch.randn(expected.shape, generator=gen).to(dtype)
    got, want = torch.autograd.grad(y, (x, w, b), grad), torch.autograd.grad(expected, (x, w, b), grad)
    for name, g, r in zip(("x", "weight", "bias"), got, want, strict=True):
        torch.testing.assert_close(g, r, **GRAD_TOL[dtype], msg=name)


def test_an_input_of_another_layout_and_no_bias():
    """A transposed (B, T, C) activation, as a model hands ``Conv1d`` its channels, is read as it is
    laid out; without a bias nothing is added."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 6, generator=gen).transpose(1, 2).requires_grad_()  # (B, C, T) strided
    w = torch.randn(6, 1, 3, generator=gen, requires_grad=True)
    y = kernel.depthwise_conv1d(x, w, None, 2)
    torch.testing.assert_close(y, _aten(x, w, None, 2), **TOL[torch.float32])
    y.sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    _aten(x, w, None, 2).sum().backward()
    torch.testing.assert_close(gx, x.grad, **GRAD_TOL[torch.float32])
    torch.testing.assert_close(gw, w.grad, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("wanted", [(True, False, False), (False, True, True), (False, False, True)])
def test_the_backward_computes_only_the_gradients_asked_for(wanted):
    gen = torch.Generator().manual_seed(1)
    gy, x, w = torch.randn(2, 4, 11, generator=gen), torch.randn(2, 4, 9, generator=gen), torch.randn(4, 1, 3, generator=gen)
    got = torch.ops.accelrun.depthwise_conv1d_backward(gy, x, w, 2, *wanted)
    want = torch.ops.aten.convolution_backward(gy, x, w, [4], [1], [2], [1], False, [0], 4, list(wanted))
    for asked, g, r in zip(wanted, got, want, strict=True):
        if asked:
            torch.testing.assert_close(g, r, **GRAD_TOL[torch.float32])
        else:
            assert g.numel() == 0


@pytest.mark.parametrize(("args", "match"), [
    ((torch.randn(2, 4, 9, dtype=torch.bfloat16), torch.randn(4, 1, 3), None, 1), "one dtype"),
    ((torch.randn(2, 4, 9), torch.randn(4, 1, 3), torch.randn(3), 1), "bias"),
    ((torch.randn(2, 4, 9), torch.randn(3, 1, 3), None, 1), "are not"),
    ((torch.randn(2, 4, 2), torch.randn(4, 1, 5), None, 0), "no output"),
])  # fmt: skip
def test_arguments_the_kernel_would_read_past_are_refused(args, match):
    """Called directly, a mismatch is an error, never a read past a buffer (the pass passes none)."""
    with pytest.raises(ValueError, match=match):
        kernel.depthwise_conv1d(*args)
    with pytest.raises(ValueError, match="grad_out"):
        torch.ops.accelrun.depthwise_conv1d_backward(torch.randn(2, 4, 5), torch.randn(2, 4, 9), torch.randn(4, 1, 3),
                                                     1, True, True, True)  # fmt: skip


def test_the_ops_pass_torch_librarys_opcheck():
    x, w, b = torch.randn(2, 4, 9, requires_grad=True), torch.randn(4, 1, 3, requires_grad=True), torch.randn(4)
    for args in ((x, w, b.requires_grad_(), 2), (x, w, None, 1)):
        results = torch.library.opcheck(torch.ops.accelrun.depthwise_conv1d.default, args)
        assert set(results.values()) == {"SUCCESS"}, results
    results = torch.library.opcheck(torch.ops.accelrun.depthwise_conv1d_backward.default,
                                    (torch.randn(2, 4, 11), x.detach(), w.detach(), 2, True, True, False))  # fmt: skip
    assert set(results.values()) == {"SUCCESS"}, results


def _rewrites(record) -> dict[str, int]:
    return {p.graph: p.counts.get("rewritten", 0) for p in record.passes if p.name == "cpu_depthwise_conv"}


def _train_beside_eager(model, tmp_path, lengths=(16,), dtype=torch.float32, steps=3):
    """``model`` compiled by accelrun, trained beside an eager copy at ``dtype``'s tolerances; the record."""
    return _compiled_beside_eager(model, tmp_path, steps, lengths=lengths, loss_tol=TOL[dtype], grad_tol=GRAD_TOL[dtype])


# The conv mixer is compiled whole (its lists hold torch.nn's modules): both of its depthwise
# convolutions are in one graph; the short convolutions' blocks share one graph, with one each.
@pytest.mark.parametrize(("model", "per_graph"), [(lambda: ConvMixer(depth=2), 2), (lambda: ShortConvLM(n_layers=2), 1)],
                         ids=["conv_mixer", "short_conv"])  # fmt: skip
def test_users_models_run_the_kernel_forward_and_backward_at_eagers_losses(model, per_graph, tmp_path):
    torch.manual_seed(0)
    record = _train_beside_eager(model(), tmp_path)
    assert _rewrites(record) == {"g0.forward": per_graph, "g0.backward": per_graph}


def test_bf16_weights_run_the_kernel_at_eagers_losses(tmp_path):
    torch.manual_seed(0)
    record = _train_beside_eager(ShortConvLM(n_layers=1).to(torch.bfloat16), tmp_path, dtype=torch.bfloat16, steps=2)
    assert _rewrites(record) == {"g0.forward": 1, "g0.backward": 1}


def test_a_length_that_changes_between_calls_keeps_the_kernel(tmp_path):
    """The kernel reads its sizes at each call: the graph for any length runs it too."""
    torch.manual_seed(0)
    record = _train_beside_eager(ShortConvLM(n_layers=1), tmp_path, lengths=(16, 24, 40, 12), steps=4)
    rewrites = _rewrites(record)
    assert len(rewrites) >= 4 and all(rewrites.values()), rewrites  # each graph (forward, backward) took it


class _Convs(nn.Module):
    """A dense Conv1d, a depthwise Conv2d and a strided depthwise Conv1d: none of them the kernel's."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Conv1d(4, 4, 3, padding=1)
        self.depthwise_2d = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.strided = nn.Conv1d(4, 4, 3, stride=2, padding=1, groups=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense(x)
        y = self.depthwise_2d(y.unsqueeze(-1).expand(-1, -1, -1, 3)).mean(-1)
        return self.strided(y)


def test_convolutions_of_other_kinds_stay_atens_and_a_strided_depthwise_one_is_reported():
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("default"), executors=["aten"]))
    model = _Convs()
    x = torch.randn(2, 4, 10, requires_grad=True)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    (forward,) = [p for p in backend.record.passes if p.name == "cpu_depthwise_conv" and p.graph.endswith("forward")]
    assert forward.counts == {"rewritten": 0, "kept": 1}
    assert "1 left to ATen (a stride, dilation or transposed convolution)" in forward.summary


def test_a_kernel_that_cannot_be_built_leaves_the_convolution_to_aten(refusing_compiler, monkeypatch):
    """A compiler that refuses the source (found on the PATH, so the pass took the call): the ops warn
    once and compute with ATen instead of failing the run."""
    monkeypatch.setattr(kernel.LIBRARY, "_built", {})  # this process's built library is put back afterwards
    x, w, b = torch.randn(2, 4, 9, requires_grad=True), torch.randn(4, 1, 3, requires_grad=True), torch.randn(4)
    with pytest.warns(UserWarning, match="could not be built"):
        y = kernel.depthwise_conv1d(x, w, b, 2)
    assert "RuntimeError" in kernel.LIBRARY.failure(torch.float32)
    torch.testing.assert_close(y, _aten(x, w, b, 2))
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    rx, rw = torch.autograd.grad(_aten(x, w, b, 2).sum(), (x, w))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)

"""Rematerialisation reads no input that may change before the backward: those the forward changes in
place, and activations it did not save anyway. A trial (2026-12-07) found three models that eager,
aot_eager and Inductor train alike, and that the default passes (remat among them) broke: a buffer
updated in the forward and an input scaled with ``mul_`` stopped the step ("modified by an inplace
operation"); an input changed through ``.data`` after the forward got silently wrong gradients (0.0
against 1.336)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import resolve_passes


class RunningScale(nn.Module):
    """A running scale kept in a buffer, updated in the forward (as an EMA of the inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        y = self.p(x * self.scale).relu()
        with torch.no_grad():
            self.scale.mul_(0.9).add_(0.1 * x.abs().mean(0))
        return self.p(y * self.scale)


class DataWrittenScale(nn.Module):
    """A buffer written through ``.data`` in the forward: no traced version counter sees it (a review's
    finding); AOTAutograd does."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 0.3))

    def forward(self, x):
        y = self.p(x) * self.scale.exp()
        self.scale.data.mul_(0.5)
        return y


class ScalesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(16, 16)

    def forward(self, x):
        x.mul_(0.5)
        return x + self.p(x)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(16, 16)

    def forward(self, x):
        return self.p(x * 2.0).relu()


def _step(model, compiled, needs_grad: bool, change_after: bool):
    torch.manual_seed(1)
    x = torch.randn(3, 16, requires_grad=needs_grad)
    x_in = x * 1.0 if needs_grad else x  # a non-leaf the forward may change in place
    loss = compiled(x_in).pow(2).mean()
    if change_after:  # the caller reuses the input's storage before the backward (no version bump)
        x_in.data.zero_()
    loss.backward()
    return loss.detach(), model.p.weight.grad.clone(), model.p.bias.grad.clone()


@pytest.mark.parametrize(("model_type", "needs_grad", "change_after"), [
    (RunningScale, False, False), (DataWrittenScale, False, False), (ScalesItsInput, True, False),
    (Plain, False, True)])
def test_remat_reads_no_input_that_changes_before_the_backward(tmp_path, model_type, needs_grad, change_after):
    torch.manual_seed(0)
    model = model_type()
    reference = copy.deepcopy(model)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("default"), executors=["cpp", "aten"],
                                             cache_dir=tmp_path))  # fmt: skip
    torch._dynamo.reset()
    got = _step(model, torch.compile(model, backend=backend), needs_grad, change_after)
    want = _step(reference, reference, needs_grad, change_after)
    torch._dynamo.reset()
    assert backend.record.dynamo_graphs == 1
    remat = [p for p in backend.record.passes if p.name == "remat"]
    assert remat  # it ran, and left these inputs alone, knowing which (AOTAutograd described them)
    assert all(p.counts["inputs_undescribed"] == 0 and "no input read" not in p.summary for p in remat)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, dict(reference.named_buffers())[name], rtol=1e-5, atol=1e-6)

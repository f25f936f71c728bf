"""Gradient clipping decides on the device: no host read of the norm (on a GPU the step would wait)."""

from __future__ import annotations

import math

import pytest
import torch

from accelrun.train.grad_clip import clip_grad_norm, clip_grad_norm_


def _params(*grads: list[float]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        out.append(p)
    return out


def _no_host_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a host read of a tensor")

    for name in ("item", "__float__", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_clips_without_reading_the_norm_on_the_host(monkeypatch):
    params = _params([3.0, 0.0], [4.0])
    _no_host_reads(monkeypatch)
    norm = clip_grad_norm_(params, 1.0)
    monkeypatch.undo()
    assert isinstance(norm, torch.Tensor) and float(norm) == pytest.approx(5.0)
    assert torch.linalg.vector_norm(torch.cat([p.grad for p in params])).item() == pytest.approx(1.0, rel=1e-5)


def test_a_small_norm_and_a_nan_norm_scale_nothing():
    params = _params([0.3], [0.4])
    assert clip_grad_norm(params, 1.0) == pytest.approx(0.5)
    assert [p.grad.item() for p in params] == pytest.approx([0.3, 0.4])
    nan = _params([float("nan")], [1.0])
    assert math.isnan(clip_grad_norm(nan, 1.0)) and nan[1].grad.item() == 1.0
    assert clip_grad_norm(_params([30.0]), math.inf) == pytest.approx(30.0)  # inf: measure only


def test_the_norms_two_reductions_under_fsdp_x_tp_are_not_a_console_warning():
    """A trial's 4-rank FSDP x TP run printed DTensor's "2 sequential all_reduce" warning on every rank's
    console, for the gradient norm's scalar."""
    import logging

    from accelrun.train.grad_clip import _one_reduction_per_mesh_dim_quiet
    from tests.logs import logged

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    with logged("torch.distributed.tensor._redistribute") as seen:
        with _one_reduction_per_mesh_dim_quiet():
            logger.warning("While redistributing from %s to %s, %d sequential %s operations", "a", "b", 2, "x")
        logger.warning("another")
    assert seen == ["another"]

"""Validation loss (``eval.every``) on this rank's held-out batches, averaged over data parallel."""

from __future__ import annotations

import torch

from accelrun.train.precision import autocast


@torch.no_grad()
def evaluate(s) -> float:
    """The mean loss over this rank's held-out micro-batches, then the mean over data-parallel ranks
    (every rank evaluates the same number of batches, so the mean of means is the mean)."""
    cfg, dev = s.config, s.device
    parts = [s.model]
    for part in parts:
        part.eval()
    total = torch.zeros((), device=dev)
    n = 0
    try:
        for inputs_BT, targets_BT in s.eval_data:
            inputs_BT, targets_BT = inputs_BT.to(dev), targets_BT.to(dev)
            with s.loss_context(), autocast(cfg.train.precision, dev):
                total += s.loss_fn(inputs_BT, targets_BT).detach().float()
            n += 1
    finally:
        for part in parts:
            part.train()
    return float(s.ctx.mean_over_dp(total / max(n, 1)))

"""Validation loss (``eval.every``) on this rank's held-out batches, averaged over data parallel."""

from __future__ import annotations

import torch

from accelrun.data.document_packing import DocumentBatch
from accelrun.data.loss_mask import count_loss_targets
from accelrun.train.precision import autocast


@torch.no_grad()
def evaluate(s) -> float:
    """The mean loss over the held-out targets of every data-parallel rank (each rank's micro-batch means
    weighted by the targets they count: with unmasked data, the mean of the batches' means)."""
    cfg, dev = s.config, s.device
    parts = [s.model]
    for part in parts:
        part.eval()
    total = torch.zeros((), device=dev)  # sum over batches of (mean loss × targets in the loss)
    counted = torch.zeros((), device=dev)
    try:
        for batch in s.eval_data:
            inputs_BT, targets_BT = batch[0].to(dev), batch[1].to(dev)
            # data.packing = document: the model attends by document here too
            positions = (batch.positions.to(dev),) if isinstance(batch, DocumentBatch) else ()
            n_targets = count_loss_targets(targets_BT)
            with s.loss_context(), autocast(cfg.train.precision, dev):
                loss = s.loss_fn(inputs_BT, targets_BT, *positions).detach().float()
            # Weighted by the targets each batch counts (all of them but chat data's masked ones), so a
            # held-out batch of user text only (a NaN mean over nothing) adds nothing.
            total += torch.where(n_targets > 0, loss * n_targets, 0.0)
            counted += n_targets
    finally:
        for part in parts:
            part.train()
    return float(s.ctx.mean_over_dp(total) / s.ctx.mean_over_dp(counted).clamp(min=1))

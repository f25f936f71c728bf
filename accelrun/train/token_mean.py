"""Chat data's (and document packing's) step loss: the mean over every target the step keeps, whatever
micro-batch holds it.

With ``data.loss_on: assistant`` micro-batches keep different numbers of targets (a window of a long
user turn keeps none). Dividing each micro-batch's mean by ``grad_accum``, and averaging ranks,
weights a target by how few others share its micro-batch; so for chat data each micro-batch's mean is
weighted by its share of the step's targets instead: ``loss_mb × n_mb / (n_step / world)``, where
``n_step / world`` is the mean over all ranks of their step's targets (``mean_over_dp``). Data-parallel
gradient averaging (FSDP divides by its ranks) and the loss's mean over ranks then give the mean over
the targets of the whole step: with ``G_r`` a rank's summed-loss gradient, ``(1/dp) Σ_r G_r × world /
Σ_ranks n = Σ_r G_r / Σ_distinct n`` (tensor-parallel ranks hold the same data: they count ``tp``
times in both sums). Without masked targets every micro-batch keeps ``B × T`` of them and the weight
is ``1 / grad_accum``: the usual mean.

The counts come from the batches on the host, so the only device work is one all-reduce of a scalar
(none on one process) and no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from accelrun.data.loss_mask import IGNORE_INDEX


def uses_token_mean(cfg, pipelined: bool) -> bool:
    """Data whose micro-batches keep different numbers of targets, outside a pipeline (whose schedule
    averages its micro-batches itself): chat data, and document packing (each boundary's target is out of
    the loss, so a micro-batch with more documents keeps fewer; weighted by its mean, a document's weight
    would depend on what it is packed with)."""
    chat = cfg.data.source == "documents" and cfg.data.format == "chat"
    return (chat or cfg.data.packing == "document") and not pipelined


def micro_batch_weights(targets: Sequence[torch.Tensor], ctx, device: torch.device) -> list[torch.Tensor]:
    """Per micro-batch of the step (``targets``: their host-side target tensors), the factor its mean
    loss is multiplied by: its targets over the mean count per rank (0-dim tensors on ``device``)."""
    counts = [int((t != IGNORE_INDEX).sum()) for t in targets]
    per_rank = ctx.mean_over_dp(torch.tensor(float(sum(counts)), device=device))
    per_rank = per_rank.clamp(min=1.0)  # a step that keeps no target anywhere: weights 0, no NaN
    return [n / per_rank for n in counts]

"""Targets that carry no loss: where a stream's loss mask is False, the target becomes ``IGNORE_INDEX``.

Cross-entropy skips such targets (``F.cross_entropy``'s default ``ignore_index``, which the models' loss
heads and the compiler's fused linear cross-entropy honour), so a masked token adds nothing to the loss
or its gradient, and the loss is the mean over the targets that count. Applying the mask here, where a
window becomes a batch, keeps every consumer (training, evaluation, pipeline stages) on one rule.

Legend for shapes: B = micro_batch, T = seq_len.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from accelrun.data.stream import TokenStream

IGNORE_INDEX = -100  # F.cross_entropy's default


def mask_targets(stream: TokenStream, window_starts: Sequence[int], seq_len: int, targets_BT: torch.Tensor) -> None:
    """Set ``targets_BT[b, t]`` to IGNORE_INDEX where the token it names (stream position
    ``window_starts[b] + t + 1``) is out of the loss; in place. Nothing to do for a stream without a mask."""
    rows = [stream.read_loss_mask(s + 1, s + seq_len + 1) for s in window_starts]
    if not rows or rows[0] is None:
        return
    keep_BT = torch.stack(rows)
    targets_BT.masked_fill_(~keep_BT, IGNORE_INDEX)


def count_loss_targets(targets_BT: torch.Tensor) -> torch.Tensor:
    """How many targets count in the loss (a 0-dim tensor on the targets' device: no host read)."""
    return (targets_BT != IGNORE_INDEX).sum()

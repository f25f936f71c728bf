"""Per-step router figures of a mixture-of-experts model, for metrics.jsonl and the report.

Summed over the step's micro-batches and layers on each rank (``MoE.pop_router_stats``) and then
over the job's ranks (one small all-reduce, which every rank joins), so they describe the whole
step's tokens whatever the layout:

- ``moe_aux_loss``: the load-balancing loss, mean over layers and micro-batches (1.0 = balanced);
- ``moe_tokens_per_expert``: (token, choice) assignments each expert was chosen for, before dropping;
- ``moe_imbalance``: max / mean of those (1.0 = balanced; n_experts / k when all go to k experts);
- ``moe_dropped_tokens`` and ``moe_dropped_frac``: assignments over capacity (model.capacity_factor).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accelrun.dist.collective import to_collective_device


def router_step_totals(model: nn.Module, distributed: bool) -> torch.Tensor | None:
    """This step's router totals summed over the job's ranks, packed in one float64 tensor on the
    model's device (None for a model without a router). Call on every rank after each step: it pops
    the step's figures and runs the all-reduce, but reads nothing on the host, so a GPU step goes on
    without waiting; :func:`router_metrics_from_totals` turns it into figures when the loop reads."""
    pop = getattr(model, "pop_router_stats", None)
    totals = pop() if callable(pop) else None
    if totals is None:
        return None
    packed = torch.cat([totals["aux_sum"].reshape(1), totals["forwards"].reshape(1),
                        totals["dropped"].reshape(1), totals["tokens_per_expert"]]).double()
    if distributed:
        home = packed.device
        packed = to_collective_device(packed, None).clone()
        dist.all_reduce(packed)
        packed = packed.to(home)
    return packed


def router_metrics_from_totals(packed: list[float]) -> dict[str, Any]:
    """The figures for metrics.jsonl from :func:`router_step_totals`' values, read on the host."""
    aux_sum, forwards, dropped = packed[:3]
    per_expert = [round(v) for v in packed[3:]]
    assigned = sum(per_expert)
    mean = assigned / len(per_expert)
    return {
        "moe_aux_loss": aux_sum / forwards,
        "moe_tokens_per_expert": per_expert,
        "moe_imbalance": max(per_expert) / mean if mean else None,
        "moe_dropped_tokens": round(dropped),
        "moe_dropped_frac": dropped / assigned if assigned else 0.0,
    }

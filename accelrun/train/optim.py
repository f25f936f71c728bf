"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from accelrun.config.schema import LRScheduleConfig, OptimizerConfig


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, device: torch.device, *, sharded: bool = False
) -> torch.optim.Optimizer:
    # Norm gains and biases (1-D) are not decayed: shrinking them toward 0 only hurts.
    groups = [{"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
              for decay, params in _groups(model.parameters())]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **_impl_flags(cfg.impl, device, sharded)
    )


def _groups(params) -> list[tuple[bool, list[nn.Parameter]]]:
    """(decayed?, parameters) per group: matrices apart from norm gains and biases, and within each,
    plain tensors apart from DTensors of each device mesh. The foreach and fused kernels take one list
    of tensors per call and refuse plain tensors mixed with DTensors (TP alone: Qwen2's q/k/v biases are
    sharded, the norms are not) or DTensors of different meshes (experts on their own)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        if p.requires_grad:
            mesh = p.device_mesh if isinstance(p, DTensor) else None
            groups.setdefault((p.ndim >= 2, mesh), []).append(p)
    # Decayed first, plain first: the single-process order (and param_groups) of before.
    order = sorted(groups, key=lambda k: (not k[0], k[1] is not None))
    return [(decay, groups[(decay, mesh)]) for decay, mesh in order]


def _impl_flags(impl: str, device: torch.device, sharded: bool) -> dict[str, bool]:
    if impl == "auto":
        # The fused kernel exists for CUDA and (since torch 2.4) for CPU; sharded (DTensor) parameters
        # on a CPU take foreach, which supports them everywhere.
        fused_ok = device.type == "cuda" or (device.type == "cpu" and not sharded)
        impl = "fused" if fused_ok else "foreach"
    return {"fused": impl == "fused", "foreach": impl == "foreach"} if impl != "for_loop" else {"foreach": False}


def lr_factor(step: int, cfg: LRScheduleConfig, total_steps: int) -> float:
    """Multiplier of the peak learning rate before optimizer step ``step`` (0-based)."""
    warmup = cfg.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    # The last step (total_steps - 1) runs at exactly the floor.
    decay_steps = max(total_steps - warmup - 1, 1)
    progress = min(max(step - warmup, 0) / decay_steps, 1.0)
    floor = cfg.min_lr_ratio
    if cfg.name == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRScheduleConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))


# What a param group's settings are, as the recipe builds them (``params`` and AdamW's state aside).
HYPERPARAMETERS = ("initial_lr", "betas", "eps", "weight_decay")


def recipe_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's ``HYPERPARAMETERS`` as built from the recipe (read before a checkpoint is loaded)."""
    return [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]


def keep_recipe_settings(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                         built: list[dict]) -> list[str]:
    """After a checkpoint's optimizer and schedule were loaded: the recipe's learning rate, betas, eps and
    weight decay again (a checkpoint's param groups carry its own), the schedule's peak from the recipe,
    and the rate of the step about to run from the recipe's schedule. A new user's run from another run's
    checkpoint with lr 0.001 trained at 0.003's schedule, weight decay and betas, none of it said.
    Returns what changed, as ``key: checkpoint's -> recipe's``; a continuation changes nothing."""
    changed: dict[str, str] = {}
    for group, recipe in zip(optimizer.param_groups, built, strict=True):
        for key, value in recipe.items():
            if not _same(group.get(key), value):
                name = "lr" if key == "initial_lr" else key
                changed.setdefault(name, f"{name}: {_said(group.get(key))} -> {_said(value)}")
                group[key] = value
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    rates = [base * scheduler.lr_lambdas[i](scheduler.last_epoch) for i, base in enumerate(scheduler.base_lrs)]
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates  # what get_last_lr() reads (torch keeps it there)
    return list(changed.values())


def _said(value) -> str:
    if isinstance(value, tuple | list):
        return "(" + ", ".join(_said(v) for v in value) + ")"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _same(a, b) -> bool:
    """Equal settings, a checkpoint's lists read as the tuples the recipe gives."""
    return (tuple(a) if isinstance(a, list) else a) == (tuple(b) if isinstance(b, list) else b)

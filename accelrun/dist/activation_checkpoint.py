"""Activation checkpointing of transformer blocks: recompute a block's activations in backward.

The block's forward is wrapped in place, so parameter names (and checkpoints) stay the same
whatever the policy. Modes: ``full`` and ``every_n`` keep only a block's input;
``selective`` (every block) also keeps its matmuls' and attention's outputs
(``accelrun.dist.selective_checkpoint``).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from accelrun.config.schema import ActivationCheckpointConfig
from accelrun.dist.selective_checkpoint import selective_context_fn
from accelrun.log_filters import leave_out


def apply_activation_checkpointing(blocks: nn.ModuleList, cfg: ActivationCheckpointConfig) -> int:
    """Wrap the blocks the policy selects; returns how many were wrapped."""
    if cfg.mode == "none":
        return 0
    if cfg.mode == "selective":
        _quiet_selective_under_compile()
    wrapped = 0
    for i, block in enumerate(blocks):
        if cfg.mode == "selective":
            block.forward = functools.partial(_checkpointed, block.forward, context_fn=selective_context_fn)
        elif cfg.mode == "full" or i % cfg.every_n == 0:
            block.forward = functools.partial(_checkpointed, block.forward)
        else:
            continue
        wrapped += 1
    return wrapped


def _quiet_selective_under_compile() -> None:
    """torch logs, once per process and on the console, that a checkpoint given a ``context_fn`` under
    torch.compile must hold no in-place ops: four raw log lines under the README's own selective example,
    about a policy accelrun passed, not the user. Left out for the process."""
    leave_out("torch._higher_order_ops.wrap", "context_fn is passed to torch.utils.checkpoint")


def is_checkpointed(method) -> bool:
    """Whether ``method`` is a block's forward as ``apply_activation_checkpointing`` wraps it."""
    return isinstance(method, functools.partial) and method.func is _checkpointed


def _checkpointed(forward, *args, context_fn=None, **kwargs):
    # Non-reentrant checkpointing composes with torch.compile, autocast and FSDP2.
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

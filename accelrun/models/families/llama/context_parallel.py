"""The Llama family's context-parallel hook (``ModelSpec.shard_sequence``)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from accelrun.models.families.llama.model import Attention


def shard_sequence(model: nn.Module, make_attention: Callable[[], nn.Module], rank: int, size: int) -> None:
    """Make ``model`` run on rank ``rank``'s chunks of each sequence (``accelrun.models.sequence_chunks``):
    rotary positions are the chunks' global ones, and every attention layer's core is
    ``make_attention()``, which brings the other ranks' keys and values (``Attention.context_parallel``)."""
    model.context_shard = (rank, size)
    for module in model.modules():
        if isinstance(module, Attention):
            module.context_parallel = make_attention()

"""The Llama family's shape as the planner counts it (torch-free; ``accelrun.plan.workload``)."""

from __future__ import annotations

from typing import Any

from accelrun.plan.workload import Shape


def plan_shape(m: Any) -> Shape:
    """From a recipe's ``model`` section (or ``LlamaArgs``): the head dimension is dim / n_heads."""
    return Shape(m.dim, m.n_layers, m.n_heads, m.kv_heads, m.ffn_dim, m.vocab_size, m.tie_embeddings,
                 family="llama")

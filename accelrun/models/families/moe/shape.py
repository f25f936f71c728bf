"""The MoE family's shape as the planner counts it (torch-free; ``accelrun.plan.moe``)."""

from __future__ import annotations

from typing import Any

from accelrun.plan.moe import MoEShape


def plan_shape(m: Any) -> MoEShape:
    """From a recipe's ``model`` section (or ``MoEArgs``): the feed-forward the timing model sees is
    the active one, ``k · moe_ffn_dim + shared_expert_ffn_dim`` wide."""
    return MoEShape(m.dim, m.n_layers, m.n_heads, m.n_kv_heads or m.n_heads,
                    m.experts_per_token * m.moe_ffn_dim + m.shared_expert_ffn_dim, m.vocab_size, m.tie_embeddings,
                    family="moe", n_experts=m.n_experts, experts_per_token=m.experts_per_token,
                    moe_ffn_dim=m.moe_ffn_dim, shared_ffn_dim=m.shared_expert_ffn_dim)

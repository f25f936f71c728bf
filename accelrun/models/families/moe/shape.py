"""The MoE family's shape (torch-free): what the planner counts (``accelrun.plan.moe``), and the
family's parameter and FLOP counts, which are that shape's with the q, k, v biases the planner leaves
out. FLOPs are on *active* parameters (a token multiplies its ``experts_per_token`` routed experts, the
shared one and the router), so MFU is on active parameters; routing's gather, scatter, softmax and
top-k are not counted, nor is capacity dropping (tokens counted as if kept)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from accelrun.plan.moe import MoEShape


def plan_shape(m: Any) -> MoEShape:
    """From a recipe's ``model`` section (or ``MoEArgs``): the feed-forward the timing model sees is
    the active one, ``k · moe_ffn_dim + shared_expert_ffn_dim`` wide."""
    return MoEShape(m.dim, m.n_layers, m.n_heads, m.n_kv_heads or m.n_heads,
                    m.experts_per_token * m.moe_ffn_dim + m.shared_expert_ffn_dim, m.vocab_size, m.tie_embeddings,
                    family="moe", n_experts=m.n_experts, experts_per_token=m.experts_per_token,
                    moe_ffn_dim=m.moe_ffn_dim, shared_ffn_dim=m.shared_expert_ffn_dim)


def _exact(args: Any) -> MoEShape:
    return replace(plan_shape(args), qkv_bias=args.qkv_bias)


def param_count(args: Any, *, embeddings: bool = True) -> int:
    """Distinct parameters of ``MoE(args)`` (every expert counted)."""
    return _exact(args).param_count(embeddings)


def active_param_count(args: Any, *, embeddings: bool = True) -> int:
    """Parameters one token uses: its top-k experts, not all of them."""
    return _exact(args).active_param_count(embeddings)


def flops_per_token(args: Any, seq_len: int) -> float:
    """Training FLOPs per token on active parameters (``Shape.model_flops_per_token``)."""
    return _exact(args).model_flops_per_token(seq_len)

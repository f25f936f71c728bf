"""The Gemma family's shape as the planner counts it, and its FLOP and parameter counts (torch-free).

Gemma's matmuls are Llama's seven per block (q, k, v, o; gate, up, down), but the attention is
``n_heads * head_dim`` wide, which need not be ``dim`` (Gemma 7B: 16 × 256 = 4096 in a 3072-wide
model); its norms hold as many weights as Llama's. So the planner's ``Shape`` with an explicit head
dimension counts it exactly, and the family's FLOPs and parameter counts are that shape's (``Shape.model_flops_per_token``, the one formula: the attention term is 4·L·T·(n_heads·head_dim)
per token). Gemma has no q, k, v biases.
"""

from __future__ import annotations

from typing import Any

from accelrun.plan.workload import Shape


def plan_shape(m: Any) -> Shape:
    """From a recipe's ``model`` section or ``GemmaArgs`` (``head_dim`` None = dim / n_heads)."""
    kv_heads = m.n_kv_heads or m.n_heads
    return Shape(m.dim, m.n_layers, m.n_heads, kv_heads, m.ffn_dim, m.vocab_size, m.tie_embeddings,
                 explicit_head_dim=m.head_dim, family="gemma")


def param_count(args: Any, *, embeddings: bool = True) -> int:
    """Distinct parameters of ``Gemma(args)`` (``embeddings=False``: without the vocabulary matrices)."""
    return plan_shape(args).param_count(embeddings)


def flops_per_token(args: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6·(N_non_embedding + V·D) + 12·L·T·(n_heads·head_dim).

    >>> from types import SimpleNamespace as NS
    >>> flops_per_token(NS(dim=64, n_layers=1, n_heads=4, n_kv_heads=None, head_dim=32, ffn_dim=128,
    ...                    vocab_size=64, tie_embeddings=True), 16)
    405120.0
    """
    return plan_shape(args).model_flops_per_token(seq_len)

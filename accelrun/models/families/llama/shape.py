"""The Llama family's shape (torch-free): what the planner counts, and the family's parameter and
FLOP counts, which are that shape's (``accelrun.plan.workload.Shape``: the one FLOP formula) with the
q, k, v biases the planner leaves out."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from accelrun.plan.workload import Shape


def plan_shape(m: Any) -> Shape:
    """From a recipe's ``model`` section (or ``LlamaArgs``): the head dimension is dim / n_heads."""
    return Shape(m.dim, m.n_layers, m.n_heads, m.kv_heads, m.ffn_dim, m.vocab_size, m.tie_embeddings,
                 family="llama")


def param_count(args: Any, *, embeddings: bool = True) -> int:
    """Distinct parameters of ``Llama(args)`` (``embeddings=False``: without the token embedding and,
    when untied, the output projection: the blocks and the final norm)."""
    return replace(plan_shape(args), qkv_bias=args.qkv_bias).param_count(embeddings)


def flops_per_token(args: Any, seq_len: int) -> float:
    """Training FLOPs per token: 6·(N_non_embedding + V·D) + 12·L·T·D (``Shape.model_flops_per_token``).

    >>> from accelrun.models.families.llama.model import LlamaArgs
    >>> flops_per_token(LlamaArgs(dim=64, n_layers=1, n_heads=4, ffn_dim=128, vocab_size=64), 16)
    283776.0
    """
    return replace(plan_shape(args), qkv_bias=args.qkv_bias).model_flops_per_token(seq_len)

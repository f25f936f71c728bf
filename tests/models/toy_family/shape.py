"""The toy family's counts (torch-free)."""

from __future__ import annotations

from typing import Any


def param_count(args: Any, *, embeddings: bool = True) -> int:
    blocks = args.n_layers * 4 * args.dim * args.dim
    return blocks + (2 * args.vocab_size * args.dim if embeddings else 0)


def flops_per_token(args: Any, seq_len: int) -> float:
    """6 FLOPs per multiplied weight (the output layer's included; the embedding is a lookup)."""
    return 6.0 * (param_count(args, embeddings=False) + args.vocab_size * args.dim)

"""Parameter and FLOP counts of the MoE family, from its shape.

FLOPs follow ``accelrun.models.flops`` (6 FLOPs per weight per token for training, attention
scores and values 6·2·L·T·D, causal half not subtracted), but on *active* parameters: a token
multiplies only its ``experts_per_token`` routed experts (plus the shared expert and the router), so

    training FLOPs per token = 6·(N_active_non_embedding + V·D) + 6·2·L·T·H·E_head.

MFU on this figure is MFU on active parameters (what the report says for this family). The
gather, scatter, softmax and top-k of routing are not counted, nor is work on tokens dropped for
capacity (counted as if kept: the model's nominal compute).
"""

from __future__ import annotations

from accelrun.models.families.moe.model import MoEArgs


def _attention_params(args: MoEArgs) -> int:
    d, e = args.dim, args.head_dim
    biases = (args.n_heads + 2 * args.kv_heads) * e if args.qkv_bias else 0
    return d * args.n_heads * e + 2 * d * args.kv_heads * e + args.n_heads * e * d + biases


def _block_params(args: MoEArgs, experts: int) -> int:
    """One block's parameters counting ``experts`` routed experts."""
    expert = 3 * args.dim * args.moe_ffn_dim
    shared = 3 * args.dim * args.shared_expert_ffn_dim
    router = args.dim * args.n_experts
    norms = 2 * args.dim
    return _attention_params(args) + router + experts * expert + shared + norms


def param_count(args: MoEArgs, *, embeddings: bool = True) -> int:
    """Distinct parameters of ``MoE(args)`` (every expert counted)."""
    n = args.n_layers * _block_params(args, args.n_experts) + args.dim
    if embeddings:
        n += (1 if args.tie_embeddings else 2) * args.vocab_size * args.dim
    return n


def active_param_count(args: MoEArgs, *, embeddings: bool = True) -> int:
    """Parameters one token uses: its top-k experts, not all of them."""
    n = args.n_layers * _block_params(args, args.experts_per_token) + args.dim
    if embeddings:
        n += (1 if args.tie_embeddings else 2) * args.vocab_size * args.dim
    return n


def forward_flops_per_token(args: MoEArgs, seq_len: int) -> float:
    matmul_weights = active_param_count(args, embeddings=False) + args.vocab_size * args.dim
    attention = 2 * 2 * args.n_layers * seq_len * args.n_heads * args.head_dim
    return float(2 * matmul_weights + attention)


def flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """Training FLOPs per token on active parameters (see the module docstring)."""
    return 3 * forward_flops_per_token(args, seq_len)

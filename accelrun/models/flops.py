"""Parameter and FLOP counts for the Llama model, computed from its shape (no model needed).

Conventions (the PaLM / Chinchilla ones, which most tools use for MFU, so figures compare):

- A matmul of an (m, k) by a (k, n) matrix costs 2·m·k·n FLOPs; the backward pass costs twice the
  forward, so training costs 3× the forward.
- Every weight matrix is used once per token: 2·N forward FLOPs per token for N weights. The token
  embedding is a lookup (no FLOPs); the output projection is a matmul, counted even when its weight is
  tied to the embedding.
- Attention scores (Q·Kᵀ) and the weighted sum of values (P·V) cost 2·T·D each per token and layer
  for a sequence of T tokens, **without** halving for the causal mask (the masked half is counted as
  if computed). Norms, activations, softmax and rotary embeddings are not counted (the norms' few
  weights sit in N_non_embedding, as in torchtitan's formula; they change nothing visible).

So, per token:  forward = 2·(N_non_embedding + V·D) + 4·L·T·D,  training = 3 × forward
             = 6·(N_non_embedding + V·D) + 6·2·L·T·D.
"""

from __future__ import annotations

from accelrun.models.families.llama.model import LlamaArgs


def _block_params(args: LlamaArgs) -> int:
    d, e = args.dim, args.head_dim
    attention = d * args.n_heads * e + 2 * d * args.kv_heads * e + args.n_heads * e * d
    feed_forward = 3 * d * args.ffn_dim
    norms = 2 * d
    biases = (args.n_heads + 2 * args.kv_heads) * e if getattr(args, "qkv_bias", False) else 0
    return attention + feed_forward + norms + biases


def param_count(args: LlamaArgs, *, embeddings: bool = True) -> int:
    """Number of distinct parameters of ``Llama(args)``.

    ``embeddings=False`` leaves out the vocabulary-sized matrices (the token embedding and, when
    untied, the output projection): what remains is the transformer blocks and the final norm.
    """
    n = args.n_layers * _block_params(args) + args.dim  # blocks + final norm
    if embeddings:
        vocab_matrices = 1 if args.tie_embeddings else 2
        n += vocab_matrices * args.vocab_size * args.dim
    return n


def forward_flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Forward-pass FLOPs per token at sequence length ``seq_len`` (see the module docstring)."""
    matmul_weights = param_count(args, embeddings=False) + args.vocab_size * args.dim
    attention = 2 * 2 * args.n_layers * seq_len * args.n_heads * args.head_dim
    return float(2 * matmul_weights + attention)


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: 6·(N_non_embedding + V·D) + 6·2·L·T·D.

    The attention term is not halved for causality (PaLM / Chinchilla convention, as used for MFU by
    most tools); see the module docstring.

    >>> flops_per_token(LlamaArgs(dim=64, n_layers=1, n_heads=4, ffn_dim=128, vocab_size=64), 16)
    283776.0
    """
    return 3 * forward_flops_per_token(args, seq_len)

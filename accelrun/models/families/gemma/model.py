"""A Gemma (1) decoder: what transformers' ``GemmaForCausalLM`` computes, in accelrun's conventions.

Where it differs from ``accelrun.models.families.llama.model`` (and why it is a family of its own):

- RMSNorm scales by ``1 + weight`` (weights start at 0), computed in fp32 and cast back at the end;
- the token embeddings are multiplied by sqrt(dim), in the activation dtype (as transformers does:
  in bf16 the factor itself is rounded to bf16);
- the feed-forward is GeGLU: ``w2(gelu_tanh(w1 x) * w3 x)``;
- the head dimension is its own key (Gemma 7B: 16 heads of 256 in a 3072-wide model), so the
  attention's width ``n_heads * head_dim`` need not equal ``dim``;
- input and output embeddings are tied (the published checkpoints; ``tie_embeddings: false`` is
  allowed for runs of accelrun's own, e.g. under pipeline parallelism).

Attention (grouped-query, rotary, causal SDPA with scale 1/sqrt(head_dim)) is Llama's module: it
already takes the head dimension from its arguments. The ends carry transformers' names
(``embed_tokens``, ``norm``, ``lm_head``); the family spec tells pipeline and tensor parallelism which
they are. Not reproduced: transformers' ``padding_idx`` (the pad row's gradient is zeroed there; with
accelrun's byte tokenizer id 0 is an ordinary byte).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accelrun.models import shard_init
from accelrun.models.families.llama.model import Attention, rope_tables


@dataclass(frozen=True)
class GemmaArgs:
    """Shape and initialisation of a Gemma model (the recipe's ``model`` keys it reads)."""

    arch: str = "gemma"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads; Gemma 2B has 1 (multi-query attention)
    head_dim: int | None = None  # None = dim / n_heads
    ffn_dim: int = 768
    vocab_size: int = 512
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.arch != "gemma":
            raise ValueError(f"model.arch: expected 'gemma', got {self.arch!r}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}) "
                                 "when model.head_dim is not set")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim = {self.head_dim} must be even (rotary embeddings rotate pairs)")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.kv_heads})")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def qkv_bias(self) -> bool:  # read by Llama's Attention
        return False

    @classmethod
    def from_config(cls, cfg: Any) -> GemmaArgs:
        """From a ``ModelConfig`` (or anything with the same attribute names)."""
        names = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "norm_eps",
                 "rope_theta", "max_seq_len", "tie_embeddings", "init_std")
        return cls(**{n: getattr(cfg, n) for n in names})


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in fp32, cast back once at the end (unlike Llama's, which casts
    the normalised value before scaling)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        shard_init.local_region(self.weight)[0].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GeGLU(nn.Module):
    """w2(gelu_tanh(w1 x) * w3 x): SwiGLU's layout (same names, same tensor-parallel plan), GELU's gate."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x_BTD), approximate="tanh") * self.w3(x_BTD))


class GemmaBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, args: GemmaArgs) -> None:
        super().__init__()
        self.attention_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.feed_forward = GeGLU(args.dim, args.ffn_dim)

    @torch.no_grad()
    def init_weights(self, std: float, seed: int | None = None) -> None:
        """Every projection ~ N(0, std) (transformers' Gemma initialisation), norms 0 (a scale of 1).
        Plain or sharded parameters: each rank fills its shard (``shard_init``)."""
        seed = shard_init.seed_or_draw(seed)
        names = {id(m): n for n, m in self.named_modules()}
        a, f = self.attention, self.feed_forward
        for linear in (a.wq, a.wk, a.wv, a.wo, f.w1, f.w3, f.w2):
            shard_init.normal_(linear.weight, std, shard_init.param_key(seed, linear, "weight", names))
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
                positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        # positions_BT by keyword: sequence parallelism's plan lays out the attention's positional inputs
        # (x, cos, sin) and passes keywords through
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_TR, sin_TR, positions_BT=positions_BT)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class Gemma(nn.Module):
    """Token ids (B, T) → logits (B, T, V), causal.

    A pipeline stage may set ``embed_tokens``, ``norm`` or ``lm_head`` to None; the forward then takes
    or returns hidden states (B, T, D) at that end instead.
    """

    def __init__(self, args: GemmaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(GemmaBlock(args) for _ in range(args.n_layers))
        self.norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # Derived from args (kept out of the state dict; init_buffers() recomputes them after to_empty).
        cos_TR, sin_TR = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos_TR, persistent=False)
        self.register_buffer("rope_sin", sin_TR, persistent=False)
        self.register_buffer("embed_scale", torch.tensor(math.sqrt(args.dim)), persistent=False)
        self.stream_shards = 1  # as Llama's: a stage's input split along the sequence (sequence parallelism)
        for name, module in self.named_modules():  # initial values are keyed by these names (shard_init)
            module._init_name = name

    @property
    def has_head(self) -> bool:
        """Whether this model (or pipeline stage) ends in the output layer, so ``head_loss`` applies."""
        return self.lm_head is not None

    def tie_weights(self) -> None:
        if self.args.tie_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def _apply(self, fn, recurse=True):
        # Moving off the meta device gives each module a fresh Parameter: tie them again.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        device = self.rope_cos.device if device is None else device
        a = self.args
        self.rope_cos, self.rope_sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, device=device)
        self.embed_scale = torch.tensor(math.sqrt(a.dim), device=device)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter and buffer in place (after ``to_empty``); the same values on any
        layout (see ``Llama.init_weights``)."""
        self.init_buffers()
        if self.rope_cos.is_meta:
            return
        a = self.args
        seed = shard_init.seed_or_draw(seed)
        if self.embed_tokens is not None:
            shard_init.normal_(self.embed_tokens.weight, a.init_std, shard_init.param_key(seed, self.embed_tokens, "weight"))
        for module in self.modules():
            if isinstance(module, GemmaBlock):
                module.init_weights(a.init_std, seed)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.lm_head is not None and not a.tie_embeddings:
            shard_init.normal_(self.lm_head.weight, a.init_std, shard_init.param_key(seed, self.lm_head, "weight"))

    def forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) in fp32; or, given targets, the mean cross-entropy loss. ``positions_BT``:
        document packing, as Llama's."""
        T = tokens_BT.shape[1] * (self.stream_shards if self.embed_tokens is None else 1)
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len ({self.args.max_seq_len})")
        if self.embed_tokens is not None:
            h_BTD = self.embed_tokens(tokens_BT)
            h_BTD = h_BTD * self.embed_scale.to(h_BTD.dtype)  # the factor rounded to the activation dtype
        else:
            h_BTD = tokens_BT
        if positions_BT is None:
            cos_TR, sin_TR = self.rope_cos[:T], self.rope_sin[:T]
        else:  # (B, T, R): positions restart at each document
            cos_TR, sin_TR = self.rope_cos[positions_BT], self.rope_sin[positions_BT]
        blocks = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in blocks:
            h_BTD = layer(h_BTD, cos_TR, sin_TR) if positions_BT is None else layer(h_BTD, cos_TR, sin_TR, positions_BT)
        if targets_BT is not None and self.lm_head is not None:
            return self.head_loss(h_BTD, targets_BT)
        if self.norm is not None:
            h_BTD = self.norm(h_BTD)
        if self.lm_head is None:
            return h_BTD
        return self.lm_head(h_BTD).float()

    def head_loss(self, h_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Final norm, output projection and mean cross-entropy (one graph under ``compile.scope: loss``)."""
        if self.norm is not None:
            h_BTD = self.norm(h_BTD)
        logits_BTV = self.lm_head(h_BTD).float()
        return F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())

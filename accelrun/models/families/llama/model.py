"""A Llama-family decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The model is written to be built on the meta device and materialised later::

    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cuda")
    model.init_weights(seed=0)

Nothing here knows about parallelism or compilation. The training loop wraps blocks in place
(activation checkpointing patches a block's ``forward``; ``Module.compile`` compiles it), and
may later replace ``model.layers[i]`` with a wrapper; the model only reaches its blocks through
``self.layers`` at call time, and initialisation finds blocks by walking ``self.modules()``.

Shape legend for suffixes and comments:
    B batch, T sequence position, D model dim, H query heads, G key/value heads,
    E head dim (D / H), R rotary pairs (E / 2), F feed-forward hidden dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accelrun.models import shard_init
from accelrun.models.document_attention import document_attention
from accelrun.models.sequence_chunks import chunk_positions


@dataclass(frozen=True)
class LlamaArgs:
    """Shape and initialisation of a Llama model (the model section of a recipe, minus ``custom``)."""

    arch: str = "llama"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads (no grouping)
    ffn_dim: int = 768
    vocab_size: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    init_std: float = 0.02
    qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections
    # Llama 3.1's long-context frequency scaling: anything with factor, low_freq_factor,
    # high_freq_factor and original_max_seq_len attributes (config.schema.RopeScalingConfig); None = none.
    rope_scaling: Any = None

    def __post_init__(self) -> None:
        # Errors name the recipe key so a user can find it (the schema checks each field alone;
        # these involve several).
        if self.arch != "llama":
            raise ValueError(f"model.arch: expected 'llama', got {self.arch!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(
                f"model.dim / model.n_heads = {self.head_dim} must be even (rotary embeddings rotate pairs)"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.kv_heads})"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_config(cls, cfg: Any) -> LlamaArgs:
        """From a ``ModelConfig`` (or anything with the same attribute names); ignores custom/kwargs."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        shard_init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype: the mean of squares loses too much in bf16.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None,
                scaling: Any = None):
    """cos and sin of the rotation angle for each position and rotary pair: two (T, R) fp32 tensors."""
    inv_freq_R = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    if scaling is not None:
        inv_freq_R = llama3_scaled_frequencies(inv_freq_R, scaling)
    pos_T = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angle_TR = torch.outer(pos_T, inv_freq_R)
    return angle_TR.cos(), angle_TR.sin()


def llama3_scaled_frequencies(inv_freq_R: torch.Tensor, scaling: Any) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths longer than the original context / low_freq_factor
    are stretched by ``factor``, shorter than original / high_freq_factor kept, and the band between
    interpolated linearly in (original context / wavelength)."""
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_seq_len
    wavelen_R = 2 * math.pi / inv_freq_R
    ratio_R = original / wavelen_R  # how many wavelengths fit in the original context
    blend_R = ((ratio_R - low) / (high - low)).clamp(0.0, 1.0)  # 0: stretch fully, 1: keep
    return inv_freq_R / factor * (1 - blend_R) + inv_freq_R * blend_R


def apply_rope(x_BTHE: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by the position's angle (Meta's reference layout).
    The tables are (T, R), one position per column, or (B, T, R) under document packing, where
    positions restart at each document."""
    x_BTHR2 = x_BTHE.float().unflatten(-1, (-1, 2))
    x0, x1 = x_BTHR2.unbind(-1)  # each (B, T, H, R)
    if cos_TR.dim() == 2:
        cos_T1R, sin_T1R = cos_TR[:, None, :].float(), sin_TR[:, None, :].float()
    else:  # (B, T, R) -> (B, T, 1, R)
        cos_T1R, sin_T1R = cos_TR[:, :, None, :].float(), sin_TR[:, :, None, :].float()
    out_BTHR2 = torch.stack((x0 * cos_T1R - x1 * sin_T1R, x0 * sin_T1R + x1 * cos_T1R), dim=-1)
    return out_BTHR2.flatten(-2).type_as(x_BTHE)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Context parallelism (the family's ``shard_sequence``) sets a module that computes causal
        # attention of this rank's sequence chunks against the whole sequence: (q, k, v) -> o.
        self.context_parallel: nn.Module | None = None

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
                positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """``positions_BT`` (document packing): each token's position in its document; attention then
        stays inside each document (block-causal) and ``cos_TR``/``sin_TR`` are (B, T, R)."""
        B, T, _ = x_BTD.shape
        # Head counts are inferred (-1) from the projections' widths, so a layer whose projections hold
        # a slice of the heads (tensor parallelism) runs unchanged.
        q_BTHE = apply_rope(self.wq(x_BTD).view(B, T, -1, self.head_dim), cos_TR, sin_TR)
        k_BTGE = apply_rope(self.wk(x_BTD).view(B, T, -1, self.head_dim), cos_TR, sin_TR)
        v_BTGE = self.wv(x_BTD).view(B, T, -1, self.head_dim)

        q_BHTE, k_BGTE, v_BGTE = (t.transpose(1, 2) for t in (q_BTHE, k_BTGE, v_BTGE))
        if self.context_parallel is not None:  # T is this rank's chunks; it brings the other ranks' keys
            o_BHTE = self.context_parallel(q_BHTE, k_BGTE, v_BGTE)
        elif positions_BT is not None:
            k_BHTE, v_BHTE = repeat_kv(k_BGTE, q_BHTE.shape[1]), repeat_kv(v_BGTE, q_BHTE.shape[1])
            o_BHTE = document_attention(q_BHTE, k_BHTE, v_BHTE, positions_BT)
        else:
            k_BHTE, v_BHTE = repeat_kv(k_BGTE, q_BHTE.shape[1]), repeat_kv(v_BGTE, q_BHTE.shape[1])
            o_BHTE = F.scaled_dot_product_attention(q_BHTE, k_BHTE, v_BHTE, is_causal=True)
        return self.wo(o_BHTE.transpose(1, 2).reshape(B, T, -1))


def repeat_kv(x_BGTE: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Key/value heads repeated to the query heads' count (grouped-query attention)."""
    # Expanded explicitly rather than passing enable_gqa=True: with enable_gqa, fp32 inputs on CUDA fall
    # back to the unfused math kernel, while an expanded plain SDPA call gets a fused kernel on every
    # backend and dtype (and is the form graph passes pattern-match).
    group = n_heads // x_BGTE.shape[1]
    return x_BGTE.repeat_interleave(group, dim=1) if group > 1 else x_BGTE  # (B, H, T, E)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float, seed: int | None = None) -> None:
        """Initialise this block's parameters (plain or sharded: each rank fills its shard).
        ``seed`` None draws one from the global RNG."""
        seed = shard_init.seed_or_draw(seed)
        names = {id(m): n for n, m in self.named_modules()}  # for a block built alone
        for linear in (self.attention.wq, self.attention.wk, self.attention.wv,
                       self.feed_forward.w1, self.feed_forward.w3):  # fmt: skip
            shard_init.normal_(linear.weight, std, shard_init.param_key(seed, linear, "weight", names))
            if linear.bias is not None:
                linear.bias.zero_()  # a DTensor zeroes its local shard
        # Projections that write into the residual stream are scaled down so the stream's variance
        # does not grow with depth (GPT-2's 1/sqrt(2 * n_layers)).
        for linear in (self.attention.wo, self.feed_forward.w2):
            shard_init.normal_(linear.weight, residual_std, shard_init.param_key(seed, linear, "weight", names))
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
                positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        # positions_BT by keyword: sequence parallelism's plan lays out the attention's positional inputs
        # (x, cos, sin) and passes keywords through
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_TR, sin_TR, positions_BT=positions_BT)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class Llama(nn.Module):
    """Token ids (B, T) → logits (B, T, V), causal.

    A pipeline stage may set ``tok_embeddings``, ``norm`` or ``output`` to None; the forward then
    takes or returns hidden states (B, T, D) at that end instead.
    """

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # Derived from args, not learned: kept out of the state dict, recomputed by init_buffers()
        # after to_empty() (which leaves buffers uninitialised).
        cos_TR, sin_TR = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling)
        self.register_buffer("rope_cos", cos_TR, persistent=False)
        self.register_buffer("rope_sin", sin_TR, persistent=False)
        # Context parallelism: (rank, size) when this model sees chunks of each sequence (the family's
        # ``shard_sequence``): rotary positions are then the chunks' global ones. None: the whole sequence.
        self.context_shard: tuple[int, int] | None = None
        # A pipeline stage without the embedding under sequence parallelism receives the residual stream
        # split along the sequence over this many TP ranks (accelrun.dist.pipeline.receive_sequence_shards):
        # its blocks gather the whole sequence, so the rotary tables must cover it.
        self.stream_shards = 1
        # Each module keeps its name in the whole model: initial values are keyed by parameter name
        # (shard_init), and stages, shards and wrappers (checkpointing, compile) must not change them.
        for name, module in self.named_modules():
            module._init_name = name

    def tie_weights(self) -> None:
        """Make the output layer share the embedding's weight (when ``tie_embeddings``)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # to_empty() (and any conversion off the meta device) gives each module a fresh Parameter,
        # which would silently untie the output layer from the embedding; tie them again.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the rotary tables (on ``device``, default: where the embeddings live)."""
        if device is None:
            device = self.rope_cos.device
        a = self.args
        self.rope_cos, self.rope_sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, device=device,
                                                   scaling=a.rope_scaling)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter and buffer in place (after ``to_empty``).

        Weights ~ normal(0, init_std); residual projections (wo, w2) and the untied output layer use
        init_std / sqrt(2 * n_layers); RMSNorm weights are 1. Parameters may be sharded (DTensors):
        each process fills its own shard, and every element gets the value one process would give it
        (``accelrun.models.shard_init``: values keyed by ``seed``, the parameter's name in the whole
        model and the element's position; the same on every device). ``seed`` None draws one from
        the global RNG.
        """
        self.init_buffers()
        if self.rope_cos.is_meta:
            return  # nothing allocated yet (to_empty first)
        a = self.args
        residual_std = a.init_std / math.sqrt(2 * a.n_layers)
        seed = shard_init.seed_or_draw(seed)
        if self.tok_embeddings is not None:
            shard_init.normal_(self.tok_embeddings.weight, a.init_std, shard_init.param_key(seed, self.tok_embeddings, "weight"))
        # Walk modules rather than self.layers so blocks wrapped by the training loop are still found.
        for module in self.modules():
            if isinstance(module, TransformerBlock):
                module.init_weights(a.init_std, residual_std, seed)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not a.tie_embeddings:
            shard_init.normal_(self.output.weight, residual_std, shard_init.param_key(seed, self.output, "weight"))

    def forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) in fp32; or, given targets, the mean cross-entropy loss over the targets that
        are not -100 (a scalar). ``positions_BT`` (document packing, ``data.packing: document``): each
        token's position in its document; rotary positions restart and attention stays inside each
        document."""
        T = tokens_BT.shape[1] * (self.stream_shards if self.tok_embeddings is None else 1)
        whole = T if self.context_shard is None else T * self.context_shard[1]
        if whole > self.args.max_seq_len:
            raise ValueError(f"sequence length {whole} exceeds model.max_seq_len ({self.args.max_seq_len})")
        h_BTD = self.tok_embeddings(tokens_BT) if self.tok_embeddings is not None else tokens_BT
        if positions_BT is not None:
            if self.context_shard is not None:
                raise ValueError("document packing (positions_BT) does not combine with context parallelism")
            cos_TR, sin_TR = self.rope_cos[positions_BT], self.rope_sin[positions_BT]  # (B, T, R)
        elif self.context_shard is None:
            cos_TR, sin_TR = self.rope_cos[:T], self.rope_sin[:T]
        else:  # this rank's chunks: each token rotated by its position in the whole sequence
            pos_T = chunk_positions(T, *self.context_shard, device=self.rope_cos.device)
            cos_TR, sin_TR = self.rope_cos[pos_T], self.rope_sin[pos_T]
        # A pipeline stage keeps its slice of the blocks in a ModuleDict keyed by layer index, so its
        # parameter names match the whole model's.
        blocks = self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers
        for layer in blocks:
            # Concat packing calls the blocks exactly as before (no extra input in their graphs).
            h_BTD = layer(h_BTD, cos_TR, sin_TR) if positions_BT is None else layer(h_BTD, cos_TR, sin_TR, positions_BT)
        if targets_BT is not None and self.output is not None:
            return self.head_loss(h_BTD, targets_BT)
        if self.norm is not None:
            h_BTD = self.norm(h_BTD)
        if self.output is None:
            return h_BTD
        # Logits in fp32 whatever the compute dtype: the loss's log-softmax needs the range.
        return self.output(h_BTD).float()

    def head_loss(self, h_BTD: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Final norm, output projection and mean cross-entropy over all positions.

        A method of its own so that ``compile.scope: loss`` can compile it as one graph (where the
        projection and the loss fuse and the full logits tensor need not exist).
        """
        if self.norm is not None:
            h_BTD = self.norm(h_BTD)
        logits_BTV = self.output(h_BTD).float()
        return F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())


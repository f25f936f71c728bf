"""Sampling one token at a time without recomputing the context: each attention layer keeps the keys and
values of the tokens before (a KV cache), so a new token costs one position's work, not the whole context's.

The model's own forward runs unchanged (embeddings, norms, feed-forward, MoE routing, the output layer);
only each ``accelrun.models.families.llama.model.Attention`` (which every built-in family uses) is given a forward that
appends to its cache, and the rotary tables are shifted to start at the cache's length, so the model's
``rope_cos[:T]`` are the new tokens' positions.

Example::

    with KVCache.attach(model) as cache:
        logits_1TV = model(prompt_1T)           # fills the cache
        logits_11V = model(next_11)             # one position's work
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from accelrun.models.families.llama.model import Attention, apply_rope, repeat_kv


def kv_cache_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot decode with a KV cache, or None when it can."""
    if not any(isinstance(m, Attention) for m in model.modules()):
        return f"{type(model).__name__} has no accelrun attention layers"
    if not (hasattr(model, "rope_cos") and hasattr(model, "rope_sin")):
        return f"{type(model).__name__} keeps no rotary tables to shift"
    if getattr(model, "context_shard", None) is not None:
        return "the model sees sequence shards (context parallelism)"
    return None


class KVCache:
    """Keys and values per attention layer, ``(B, G, L, E)`` each; ``length`` positions so far."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.length = 0
        self.keys: dict[Attention, torch.Tensor] = {}
        self.values: dict[Attention, torch.Tensor] = {}
        self.cos_TR, self.sin_TR = model.rope_cos, model.rope_sin  # the whole tables, from position 0

    @classmethod
    @contextlib.contextmanager
    def attach(cls, model: nn.Module) -> Iterator[KVCache]:
        """The model runs through its cache inside the block; its own forwards are back after it."""
        cache = cls(model)
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        for attn in layers:
            attn.forward = cache._forward_of(attn)  # an instance attribute: nn.Module calls it
        try:
            yield cache
        finally:
            for attn in layers:
                del attn.forward
            model.rope_cos, model.rope_sin = cache.cos_TR, cache.sin_TR

    def reset(self) -> None:
        """Forget every position (the next input starts at position 0)."""
        self.length = 0
        self.keys.clear()
        self.values.clear()

    def __call__(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """The model's logits for ``tokens_BT``, which follow the cached positions (B, T, V)."""
        T = tokens_BT.shape[1]
        if self.length + T > self.cos_TR.shape[0]:
            raise ValueError(f"{self.length + T} positions exceed model.max_seq_len ({self.cos_TR.shape[0]})")
        # The model slices its tables from 0: shifted, [:T] are the new tokens' positions.
        self.model.rope_cos, self.model.rope_sin = self.cos_TR[self.length:], self.sin_TR[self.length:]
        logits = self.model(tokens_BT)
        self.length += T
        return logits

    def _forward_of(self, attn: Attention):
        """``attn``'s forward, reading and extending this cache (Attention.forward, plus the cache)."""
        def forward(x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor,
                    positions_BT: torch.Tensor | None = None) -> torch.Tensor:
            # Generation runs one prompt as one document: the blocks pass positions_BT=None.
            assert positions_BT is None, "the KV cache decodes one document (no document packing)"
            B, T, _ = x_BTD.shape
            q_BTHE = apply_rope(attn.wq(x_BTD).view(B, T, -1, attn.head_dim), cos_TR, sin_TR)
            k_BTGE = apply_rope(attn.wk(x_BTD).view(B, T, -1, attn.head_dim), cos_TR, sin_TR)
            v_BTGE = attn.wv(x_BTD).view(B, T, -1, attn.head_dim)
            q_BHTE, k_BGTE, v_BGTE = (t.transpose(1, 2) for t in (q_BTHE, k_BTGE, v_BTGE))
            if attn in self.keys:  # (B, G, L + T, E): the cached positions, then the new ones
                k_BGTE = torch.cat((self.keys[attn], k_BGTE), dim=2)
                v_BGTE = torch.cat((self.values[attn], v_BGTE), dim=2)
            self.keys[attn], self.values[attn] = k_BGTE, v_BGTE
            H = q_BHTE.shape[1]
            # Causal among the new tokens only when there is no past (the prompt); a single new token
            # sees every cached position. Several new tokens after a past would need an offset mask.
            if T > 1 and self.length > 0:
                raise ValueError("a KV cache takes several tokens only as its first input")
            o_BHTE = F.scaled_dot_product_attention(q_BHTE, repeat_kv(k_BGTE, H), repeat_kv(v_BGTE, H),
                                                    is_causal=T > 1)
            return attn.wo(o_BHTE.transpose(1, 2).reshape(B, T, -1))

        return forward

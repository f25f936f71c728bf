"""Model code nobody here wrote (transformers' causal LMs) and plain-nn models, at tiny sizes, for the
compiler's differential corpus (``test_hf_corpus.py``). Nothing is downloaded: every model is built
from a config with random weights.

Each builder returns ``(model, batch)``; ``loss_of(model, batch)`` is the scalar a step differentiates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH = 64, 8, 2


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _hf(config_cls: str, model_cls: str, **cfg: Any) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        import transformers

        config = getattr(transformers, config_cls)(vocab_size=VOCAB, **cfg)
        model = getattr(transformers, model_cls)(config)
        ids = _ids()
        return model, {"input_ids": ids, "labels": ids}

    return build


_LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip


def _rotate(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class FusedQKVBlock(nn.Module):
    """A Llama block written another way: one q/k/v Linear split in three, RoPE as chunk + cat, the
    gate and up projections as one Linear chunked in two."""

    def __init__(self, dim: int = 32, heads: int = 4, ffn: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.o = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.up, self.down = nn.Linear(dim, 2 * ffn, bias=False), nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.n1(x)).split(d, dim=-1))
        q, k = q * cos + _rotate(q) * sin, k * cos + _rotate(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        g, u = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class FusedQKVLlama(nn.Module):
    def __init__(self, layers: int = 2, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, dim), nn.Linear(dim, VOCAB, bias=False)
        self.layers = nn.ModuleList(FusedQKVBlock(dim, heads) for _ in range(layers))
        self.head_dim = dim // heads

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(t).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.emb.weight.dtype), emb.sin().to(self.emb.weight.dtype)
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), labels.flatten())


class ConvNet(nn.Module):
    """Convolutions, batch norm (running statistics: state), pooling, then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.GELU(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.classifier = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.classifier(self.features(x).flatten(1)).float(), y)


class Conv1dNorms(nn.Module):
    """1-d convolutions with group norm, layer norm, average pooling and a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.g1 = nn.Conv1d(4, 16, 5, padding=2), nn.GroupNorm(4, 16)
        self.c2, self.ln = nn.Conv1d(16, 16, 3, padding=1), nn.LayerNorm(16)
        self.pool, self.out = nn.AvgPool1d(2), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.g1(self.c1(x)))
        h = h + torch.tanh(self.c2(h))
        h = self.ln(self.pool(h).transpose(1, 2)).mean(1)
        return F.cross_entropy(self.out(h).float(), y)


def _plain(cls: type[nn.Module], make_batch: Callable[[], dict]) -> Callable[[], tuple[nn.Module, Any]]:
    return lambda: (cls(), make_batch())


MODELS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {
    "llama": _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA_LIKE),
    "mistral": _hf("MistralConfig", "MistralForCausalLM", **_LLAMA_LIKE),
    "qwen2": _hf("Qwen2Config", "Qwen2ForCausalLM", **_LLAMA_LIKE),
    "gemma": _hf("GemmaConfig", "GemmaForCausalLM", head_dim=8, **_LLAMA_LIKE),
    "phi3": _hf("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, bos_token_id=1, eos_token_id=2, **_LLAMA_LIKE),
    "gpt2": _hf("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=1, n_head=4, n_positions=32,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),  # fmt: skip
    "mixtral": _hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                   **_LLAMA_LIKE),  # fmt: skip
    "fused_qkv_llama": _plain(FusedQKVLlama, lambda: {"input_ids": _ids(), "labels": _ids()}),
    "convnet": _plain(ConvNet, lambda: {"x": torch.randn(4, 3, 8, 8), "y": torch.randint(0, 10, (4,))}),
    "conv1d_norms": _plain(Conv1dNorms, lambda: {"x": torch.randn(4, 4, 16), "y": torch.randint(0, 5, (4,))}),
}


def loss_of(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss

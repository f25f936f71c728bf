"""A language model written the way users write them, for ``model.custom`` (README: "Your own model").

    accelrun train configs/llama.yaml model.custom=examples.my_model:build train.steps=20

accelrun calls ``build(**model.kwargs)`` and trains what it returns: ``forward(tokens)`` takes token ids
[batch, seq] and returns logits [batch, seq, vocab] (or a tuple led by them, or an object or dict with
``logits``); accelrun computes the cross-entropy. The token embedding's rows are the ids the model takes.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 320, dim: int = 64, layers: int = 2, heads: int = 4, max_seq: int = 256) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_seq, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(seq, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        return self.head(self.norm(self.blocks(x, mask=causal, is_causal=True)))


def build(vocab: int = 320, dim: int = 64, layers: int = 2, heads: int = 4) -> TinyGPT:
    return TinyGPT(vocab, dim, layers, heads)

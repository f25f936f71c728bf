"""Token ids (B, T) -> logits (B, T, V): an embedding, ``n_layers`` residual MLP blocks, a norm and an
output layer. No attention: the smallest model that exercises a family's contract (meta build,
``init_weights(seed)`` keyed by parameter name, repeated blocks in ``layers``, a loss head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accelrun.models import shard_init


@dataclass(frozen=True)
class ToyArgs:
    dim: int = 16
    n_layers: int = 2
    vocab_size: int = 32
    init_std: float = 0.02

    @classmethod
    def from_config(cls, cfg: Any) -> ToyArgs:
        return cls(cfg.dim, cfg.n_layers, cfg.vocab_size, cfg.init_std)


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return x_BTD + self.down(F.gelu(self.up(x_BTD)))


class Toy(nn.Module):
    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(ToyBlock(args.dim) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim, elementwise_affine=False)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        for name, module in self.named_modules():  # initial values are keyed by these names
            module._init_name = name

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        seed = shard_init.seed_or_draw(seed)
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                shard_init.normal_(module.weight, self.args.init_std, shard_init.param_key(seed, module, "weight"))

    def forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor | None = None) -> torch.Tensor:
        h_BTD = self.embed(tokens_BT)
        for block in self.layers:
            h_BTD = block(h_BTD)
        logits_BTV = self.output(self.norm(h_BTD)).float()
        if targets_BT is None:
            return logits_BTV
        return F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten())

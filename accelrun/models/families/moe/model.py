"""A mixture-of-experts decoder (Mixtral / Qwen-MoE / DeepSeek style): Llama's attention, norms and
rotary embeddings, with each block's feed-forward replaced by a token-choice top-k router over
``n_experts`` SwiGLU experts, plus an optional shared expert every token goes through.

Routing (per token): softmax over the router's logits; the top ``experts_per_token`` experts are
chosen and their probabilities renormalised to sum to 1 (Mixtral's gate). An expert's output is
weighted by its gate and summed.

Capacity (``capacity_factor``, None = no dropping): within each *sequence*, an expert takes at most
``ceil(capacity_factor · T · k / E)`` of the sequence's assignments, earlier tokens first; the rest
are dropped (their expert output is 0, the residual stream passes them through). Counting per
sequence makes which tokens are dropped independent of how a batch is split over ranks and
micro-batches, so data- and expert-parallel runs equal one process.

Load-balancing loss (Switch / Mixtral): ``E · Σ_e f_e · P_e`` with ``f_e`` the fraction of the
sequence's assignments routed to expert e (before dropping) and ``P_e`` the mean router probability
of e over the sequence's tokens; 1 when perfectly balanced. Computed per sequence and averaged (for
the same reason as capacity), then averaged over layers; the model's training loss is
``cross-entropy + aux_loss_coef · aux``.

Experts are computed as grouped matmuls (``accelrun.models.families.moe.experts``): tokens sorted by expert,
experts' weights stacked as (E, D, F) tensors. Under expert parallelism (``accelrun.dist.expert_parallel``)
each rank holds E / ep of them and tokens travel by all-to-all.

Shape legend as in ``accelrun.models.families.llama.model``, plus: N tokens (B·T), X experts (E is the head dim
there), K experts per token, A assignments (N·K), C expert hidden dim (``moe_ffn_dim``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accelrun.models import shard_init
from accelrun.models.families.llama.model import FeedForward, Llama, LlamaArgs, TransformerBlock
from accelrun.models.families.moe.experts import Routing, expert_forward, route


@dataclass(frozen=True)
class MoEArgs(LlamaArgs):
    """A Llama's shape plus the experts'."""

    arch: str = "moe"
    n_experts: int = 8
    experts_per_token: int = 2
    moe_ffn_dim: int = 256
    shared_expert_ffn_dim: int = 0  # 0 = no shared expert
    aux_loss_coef: float = 0.01
    capacity_factor: float | None = None  # None = no dropping

    def __post_init__(self) -> None:
        if self.arch != "moe":
            raise ValueError(f"model.arch: expected 'moe', got {self.arch!r}")
        # The attention's checks are Llama's own.
        LlamaArgs(**{f.name: getattr(self, f.name) for f in fields(LlamaArgs)} | {"arch": "llama"})
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"model.experts_per_token ({self.experts_per_token}) must be between 1 and "
                             f"model.n_experts ({self.n_experts})")

    def capacity(self, seq_len: int) -> int | None:
        """Assignments one expert takes per sequence; None = unlimited."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * seq_len * self.experts_per_token / self.n_experts))


class Experts(nn.Module):
    """``n_experts`` SwiGLU feed-forwards as stacked weights: w1, w3 (X, D, C) and w2 (X, C, D).

    Under expert parallelism the three are DTensors sharded along the expert dimension; forward
    then computes this rank's experts on the tokens the all-to-all brought (``dispatcher``).
    """

    def __init__(self, n_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))  # up
        self.w2 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # down
        self.dispatcher: Any = None  # accelrun.dist.expert_parallel sets it; None = all experts here

    def forward(self, x_ND: torch.Tensor, routing: Routing) -> torch.Tensor:
        return expert_forward(x_ND, routing, self.w1, self.w3, self.w2, self.dispatcher)


class MoEFeedForward(nn.Module):
    """Router + routed experts (+ a shared expert). Records this call's router figures on itself
    (``stats``) for the model to collect once per forward."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = Experts(args.n_experts, args.dim, args.moe_ffn_dim)
        self.shared_expert = (FeedForward(args.dim, args.shared_expert_ffn_dim)
                              if args.shared_expert_ffn_dim > 0 else None)
        self.stats: dict[str, torch.Tensor] | None = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        # The router in fp32: top-k choices must not flip with the activation dtype.
        with torch.autocast(x_ND.device.type, enabled=False):
            logits_NX = F.linear(x_ND.float(), self.router.weight.float())
        routing = route(logits_NX, B, T, self.args.experts_per_token, self.args.capacity(T))
        y_ND = self.experts(x_ND, routing)
        if self.shared_expert is not None:
            y_ND = y_ND + self.shared_expert(x_ND)
        self.stats = {"aux": routing.aux_loss, "tokens_per_expert": routing.tokens_per_expert.detach(),
                      "dropped": routing.dropped.detach()}
        return y_ND.view(B, T, D)


class MoEBlock(TransformerBlock):
    """Llama's pre-norm block with the MoE feed-forward."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__(args)
        self.feed_forward = MoEFeedForward(args)

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float, seed: int | None = None) -> None:
        seed = shard_init.seed_or_draw(seed)
        names = {id(m): n for n, m in self.named_modules()}
        attn = self.attention
        for linear in (attn.wq, attn.wk, attn.wv):
            shard_init.normal_(linear.weight, std, shard_init.param_key(seed, linear, "weight", names))
            if linear.bias is not None:
                linear.bias.zero_()
        shard_init.normal_(attn.wo.weight, residual_std, shard_init.param_key(seed, attn.wo, "weight", names))
        moe = self.feed_forward
        shard_init.normal_(moe.router.weight, std, shard_init.param_key(seed, moe.router, "weight", names))
        for leaf, scale in (("w1", std), ("w3", std), ("w2", residual_std)):
            shard_init.normal_(getattr(moe.experts, leaf), scale, shard_init.param_key(seed, moe.experts, leaf, names))
        if moe.shared_expert is not None:
            s = moe.shared_expert
            for linear, scale in ((s.w1, std), (s.w3, std), (s.w2, residual_std)):
                shard_init.normal_(linear.weight, scale, shard_init.param_key(seed, linear, "weight", names))
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class MoE(Llama):
    """Token ids (B, T) → logits; given targets, cross-entropy + aux_loss_coef · load-balancing loss
    (training mode; in eval mode the cross-entropy alone)."""

    # compile.scope = model: the whole forward through accelrun's cross-process graph cache (torch's
    # precompile path) returned the cross-entropy without the aux term here, while an ordinary
    # torch.compile of the same forward is right; so that path is declined for this forward (its blocks
    # and its loss head, what compile.scope = auto compiles, still use it and match eager).
    graph_cache_declines_forward = (
        "the whole MoE forward is compiled afresh in each process: its load-balancing loss, summed from what "
        "its blocks record, is added outside the graphs the cache can save (compile.scope = block or auto "
        "caches the blocks and the loss head)")

    def __init__(self, args: MoEArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleList(MoEBlock(args) for _ in range(args.n_layers))
        for name, module in self.named_modules():  # the new blocks' names (Llama's constructor set the rest)
            module._init_name = name
        self._router_totals: dict[str, torch.Tensor] | None = None

    def moe_layers(self) -> list[MoEFeedForward]:
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def forward(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(tokens_BT, targets_BT, positions_BT)
        if not self.training:
            return out
        layers = self.moe_layers()
        aux = torch.stack([m.stats["aux"] for m in layers]).mean()
        self._collect(layers, aux)
        if targets_BT is None:
            return out
        return out + self.args.aux_loss_coef * aux

    @torch.no_grad()
    def _collect(self, layers: list[MoEFeedForward], aux: torch.Tensor) -> None:
        # Summed over micro-batches until pop_router_stats (once per optimizer step).
        now = {"aux_sum": aux.detach().float(), "forwards": torch.ones((), device=aux.device),
               "tokens_per_expert": torch.stack([m.stats["tokens_per_expert"] for m in layers]).sum(0).float(),
               "dropped": torch.stack([m.stats["dropped"] for m in layers]).sum().float()}
        if self._router_totals is None:
            self._router_totals = now
        else:
            self._router_totals = {k: self._router_totals[k] + v for k, v in now.items()}

    def pop_router_stats(self) -> dict[str, torch.Tensor] | None:
        """This process's router figures since the last call (summed over layers and micro-batches):
        aux_sum and forwards (their ratio is the mean aux loss), tokens_per_expert (assignments,
        before dropping), dropped (assignments over capacity)."""
        totals, self._router_totals = self._router_totals, None
        return totals

"""Context parallelism: each sequence split along its length over the ``cp`` ranks of the mesh.

Layout (``accelrun.models.sequence_chunks``): the ``T`` tokens are cut into ``2·cp`` chunks and rank
``r`` holds chunks ``r`` and ``2·cp−1−r``, so every rank does the same causal-attention work. Every
token-wise part of the model (embeddings, norms, projections, feed-forward, the loss) runs on the
rank's own ``2·T/cp`` tokens unchanged; rotary embeddings use the tokens' global positions (the
model's ``context_shard``); only attention needs the other ranks' tokens.

Attention: an all-gather of keys and values along ``cp`` (one collective per layer, keys and values
stacked), then attention for each of the two local chunks over the keys up to its own end: on a CPU
two fused flash-attention calls (the prefix unmasked, the diagonal block causal) merged by their
log-sum-exps (``accelrun.dist.blockwise_attention``: no mask tensor); elsewhere SDPA with a
lower-right-aligned causal mask (whose float copy, ``c × (j+1)·c`` for chunk j, SDPA keeps for
backward; not yet run on a GPU).

Why an all-gather rather than a ring exchange: one collective whose backward (a reduce-scatter of
the key/value gradients) autograd derives by itself, which the compiler traces as a functional
collective, with no online-softmax merge across ranks. Its memory cost: a rank holds the whole
sequence's keys and values of every layer, ``2·B·G·T·E`` elements (G key/value heads; H with the
masked path) instead of ``1/cp`` of them, and autograd keeps them for backward; everything else a
layer saves (queries, outputs, the feed-forward's activations, the logits) is divided by ``cp``.
With grouped-query attention that is a small share (debug Llama, seq_len 8192, cp 2: a rank saves
0.51 of one process's bytes). A ring would hold two chunks of keys and values at a time and overlap
its ``cp − 1`` point-to-point steps with attention, at the price of a log-sum-exp merge per step
and a hand-written backward (docs/layout.md). The exchange is not overlapped with compute here
(``accelrun.plan.context_parallel``).

Gradients: each rank's loss covers its own tokens, so parameters' gradients are summed over ``cp``
like data parallel ones: FSDP shards and reduces over ``dp_shard × cp`` (``accelrun.dist.mesh``).
The loss is rescaled so that FSDP's mean over those ranks is the whole sequence's mean
(:func:`context_parallel_loss`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from accelrun.config.errors import ConfigError
from accelrun.data.loader import Batch
from accelrun.dist.blockwise_attention import prefix_causal_attention
from accelrun.dist.collective import to_collective_device
from accelrun.models.families.llama.model import repeat_kv
from accelrun.models.sequence_chunks import chunk_ids, sequence_from_rank_chunks, take_local_chunks
from accelrun.torch_private import functional_collectives as funcol

IGNORE_INDEX = -100  # cross-entropy's default: targets that carry no loss
# The functional all-gather with a backward (a reduce-scatter); named differently across torch versions.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


@dataclass
class ContextParallelStats:
    """What this rank's context-parallel attention exchanged per step (forward all-gathers; the
    backward sends the same bytes back as reduce-scatters).

    Eager gathers count themselves: calls, bytes received and seconds blocked. Gathers inside compiled
    blocks are graph nodes that cannot: for a step in which no eager gather ran, calls and bytes are
    counted from the model's forwards instead (each attention layer receives
    ``received_bytes_per_token`` per local token), and their time is not measured."""

    calls: int = 0  # eager all-gathers of keys and values
    bytes: int = 0  # bytes they received (the other ranks' share)
    seconds: float = 0.0  # blocked waiting for them
    layers: int = 0  # attention layers that gather, per forward
    received_bytes_per_token: float = 0.0  # per layer: (k, v) × kv width per TP rank × element bytes × (cp − 1)
    forwards: int = 0  # the model's forward passes (a pre-hook outside any graph)
    forward_tokens: int = 0  # and the local tokens they ran
    _at_step: tuple[int, int, float, int, int] = (0, 0, 0.0, 0, 0)

    def count_forward(self, module: nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling():  # a whole-model graph: not counted
            self.forwards += 1
            self.forward_tokens += args[0].numel()

    def step_metrics(self) -> dict[str, float]:
        """This step's figures (since the last call), for metrics.jsonl; none when nothing was counted
        (zeros would read as "no communication")."""
        c0, b0, s0, f0, t0 = self._at_step
        self._at_step = (self.calls, self.bytes, self.seconds, self.forwards, self.forward_tokens)
        if self.calls > c0:
            return {"cp_gathers": self.calls - c0, "cp_bytes": self.bytes - b0, "cp_comm_s": self.seconds - s0}
        if self.forwards > f0 and self.layers:  # compiled blocks: counted from the forwards, not timed
            return {"cp_gathers": (self.forwards - f0) * self.layers,
                    "cp_bytes": int((self.forward_tokens - t0) * self.layers * self.received_bytes_per_token)}
        return {}


class LoadBalancedCausalAttention(nn.Module):
    """Causal attention of this rank's (head, tail) chunks against the whole sequence's keys and values.

    ``(q (B, H, L, E), k (B, G, L, E), v (B, G, L, E)) -> o (B, H, L, E)``, ``L = 2c`` local tokens.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, stats: ContextParallelStats | None) -> None:
        super().__init__()
        self.group, self.rank, self.size, self.stats = group, rank, size, stats

    def forward(self, q_BHLE: torch.Tensor, k_BGLE: torch.Tensor, v_BGLE: torch.Tensor) -> torch.Tensor:
        k_BGTE, v_BGTE = self.gather_kv(k_BGLE, v_BGLE)
        H, c = q_BHLE.shape[1], q_BHLE.shape[2] // 2
        if q_BHLE.device.type == "cpu":  # per chunk two flash calls merged by log-sum-exp: no mask to keep,
            # and the whole sequence's keys kept with their own G heads, not repeated to H
            return torch.cat([prefix_causal_attention(q_BHLE[:, :, i * c:(i + 1) * c], k_BGTE, v_BGTE, chunk)
                              for i, chunk in enumerate(chunk_ids(self.rank, self.size))], dim=2)
        k_BHTE, v_BHTE = repeat_kv(k_BGTE, H), repeat_kv(v_BGTE, H)
        outs = []
        for i, chunk in enumerate(chunk_ids(self.rank, self.size)):
            q_BHcE = q_BHLE[:, :, i * c:(i + 1) * c]
            end = (chunk + 1) * c  # this chunk attends to keys 0 .. end-1
            # Query i of the chunk is token chunk·c + i: key s is visible when s <= chunk·c + i.
            mask_cS = torch.ones(c, end, dtype=torch.bool, device=q_BHLE.device).tril(chunk * c)
            outs.append(F.scaled_dot_product_attention(q_BHcE, k_BHTE[:, :, :end], v_BHTE[:, :, :end],
                                                       attn_mask=mask_cS))
        return torch.cat(outs, dim=2)

    def gather_kv(self, k_BGLE: torch.Tensor, v_BGLE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole sequence's keys and values (B, G, T, E), in sequence order, from every rank's chunks.
        One functional all-gather (autograd: its backward reduce-scatters the gradients)."""
        B, G, L, E = k_BGLE.shape
        kv_SBG2cE = torch.stack([k_BGLE, v_BGLE]).unflatten(3, (2, L // 2)).contiguous()
        counting = self.stats is not None and not torch.compiler.is_compiling()
        t0 = time.perf_counter() if counting else 0.0
        gathered = _all_gather(kv_SBG2cE, 0, self.group)  # (cp·2, B, G, 2, c, E)
        if counting:
            if isinstance(gathered, funcol.AsyncCollectiveTensor):
                gathered = gathered.wait()
            self.stats.calls += 1
            self.stats.bytes += kv_SBG2cE.numel() * kv_SBG2cE.element_size() * (self.size - 1)
            self.stats.seconds += time.perf_counter() - t0
        kv_RSBG2cE = gathered.unflatten(0, (self.size, 2))
        kv_SBGTE = sequence_from_rank_chunks(kv_RSBG2cE, seq_dim=4)
        k_BGTE, v_BGTE = kv_SBGTE.unbind(0)  # (select's backward would zero a whole-size gradient each)
        return k_BGTE, v_BGTE


def apply_context_parallel(model: nn.Module, model_cfg: Any, mesh, stats: ContextParallelStats | None,
                           element_bytes: int = 4) -> None:
    """Give the model's attention this rank's sequence chunks, through its family's ``shard_sequence``.
    ``element_bytes``: of the keys and values exchanged (the compute dtype's), for ``stats``."""
    from accelrun.models.build import family_spec

    spec = family_spec(model_cfg) if model_cfg.custom is None else None
    if spec is None or spec.shard_sequence is None:
        what = f"model.custom = {model_cfg.custom!r}" if spec is None else f"model.arch = {model_cfg.arch!r}"
        raise ConfigError(f"parallel.cp = {mesh['cp'].size()}: the attention of {what} cannot be sharded "
                          "along the sequence (its model family has no shard_sequence)")
    cp = mesh["cp"]
    rank, size, group = cp.get_local_rank(), cp.size(), cp.get_group()
    made = []

    def attention() -> LoadBalancedCausalAttention:
        made.append(LoadBalancedCausalAttention(group, rank, size, stats))
        return made[-1]

    spec.shard_sequence(model, attention, rank, size)
    if stats is not None:
        head_dim = getattr(model_cfg, "head_dim", None) or model_cfg.dim // model_cfg.n_heads
        kv_width = model_cfg.kv_heads * head_dim / mesh["tp"].size()
        stats.layers += len(made)
        stats.received_bytes_per_token = 2 * kv_width * element_bytes * (size - 1)
        model.register_forward_pre_hook(stats.count_forward)


def context_parallel_loss(loss_fn: Callable, group: dist.ProcessGroup, size: int) -> Callable:
    """``(inputs, targets) -> loss`` whose mean over the ``cp`` ranks is the whole sequence's mean.

    Each rank's loss is its tokens' mean; ranks may count different tokens (ignored targets), so it
    is rescaled by its share of the sequence's counted tokens, times ``cp`` because FSDP (and the
    loop's loss average) divide by the ranks they average over."""

    def loss(inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        mean = loss_fn(inputs_BT, targets_BT)
        local = (targets_BT != IGNORE_INDEX).sum()
        total = to_collective_device(local.detach(), group).clone()
        dist.all_reduce(total, group=group)
        total = total.to(local.device).clamp(min=1)
        # A rank whose targets are all ignored has a NaN mean; it contributes nothing.
        return torch.where(local > 0, mean * local, torch.zeros_like(mean)) * size / total

    return loss


class ContextShardedBatches:
    """A batch iterator whose batches are cut to this rank's (head, tail) chunks of every sequence.
    The cp ranks of one data-parallel rank read the same sequences (same ``dp_rank``); the state is
    the inner iterator's, so a checkpoint resumes under any cp degree."""

    def __init__(self, inner, rank: int, size: int) -> None:
        self.inner, self.rank, self.size = inner, rank, size

    def __iter__(self) -> ContextShardedBatches:
        return self

    def __next__(self) -> Batch:
        inputs_BT, targets_BT = next(self.inner)
        return Batch(take_local_chunks(inputs_BT, self.rank, self.size),
                     take_local_chunks(targets_BT, self.rank, self.size))

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # seq_len, fingerprint, ... of the inner iterator
        return getattr(self.inner, name)

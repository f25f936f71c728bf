"""Time of one optimizer step on one device, as named parts.

Compute, per pipeline micro-batch ("chunk") and stage:

- matmuls: each weight's forward product (2·tokens·in·out FLOPs) and its two backward products, at
  the device's matmul rate for that product's width; checkpointed blocks run their forward again
  (selective checkpointing only the matmuls it did not keep: wk, wo, w3);
- attention: FLOPs the fused kernel executes (causal: half the scores; backward 2.5× forward),
  again in forward for fully checkpointed blocks;
- elementwise: bytes of ``accelrun.plan.traffic`` at the device's memory rate (recomputed blocks
  stream their forward twice); autocast's weight casts; the optimizer and gradient clipping.

Communication, per chunk: FSDP gathers each block's parameters before forward (and again before
backward when blocks are resharded) and reduce-scatters its fp32 gradients after backward; HSDP
all-reduces the shards across replicas. FSDP prefetches one block ahead, so a block's collectives hide
behind the neighbouring block's compute: what is exposed is the root's and first block's gather, the
last reduce-scatters, and any block whose collectives outlast that compute; FSDP's copies into and
out of its communication buffers count as elementwise work. On a CPU, gloo moves
the bytes with the same cores that compute, so nothing is hidden. Under pipelining, torch's
``PipelineStage`` turns gradient sync off for every micro-batch's backward but the last and does not
reshard after backward: a block's gradients are reduce-scattered once per pipeline flush (one per
accumulation step), its unsharded gradients are added up in fp32 meanwhile (elementwise work), and
a block left gathered by a backward is not gathered again by the next forward. With
``reshard_after_forward``, under 1F1B-like schedules every backward re-gathers (a forward came
between) and so do the first rank's ``min(pp, m)`` forwards before its steady state; under GPipe
every forward gathers and only the first backward does. Without pipelining accelrun's loop keeps FSDP2's defaults and
reduce-scatters after every micro-batch.

Tensor parallelism (Megatron) all-reduces activations twice per block in forward and twice in
backward, all-reduces the embedding's output and gathers full logits. With sequence parallelism
each all-reduce becomes an all-gather before the column-parallel projections and a reduce-scatter
after the row-parallel ones (the same bytes on a ring), the embedding's output is reduce-scattered,
and norms and residual adds work on a ``1/tp`` slice of the sequence. With loss parallelism the
logits are never gathered: the loss all-reduces three fp32 numbers per token (max, sum of
exponentials, the target's logit). Pipeline stages send activations forward and gradients back;
eager PyTorch overlaps none of these. The pipeline bubble is in ``accelrun.plan.pipeline``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from accelrun.plan import efficiency as eff
from accelrun.plan.cluster import Cluster, DeviceRates
from accelrun.plan.comm import all_gather_s, all_reduce_s, group_link, reduce_scatter_s, send_s
from accelrun.plan.context_parallel import cp_gather_s, cp_reduce_s
from accelrun.plan.memory import StageParams, stage_params, stages
from accelrun.plan.moe import ep_of, expert_parallel_s, routed_share
from accelrun.plan.pipeline import bubble_units
from accelrun.plan.traffic import (
    AUTOCAST_CAST_BYTES_PER_PARAM,
    CLIP_BYTES_PER_PARAM,
    OPTIMIZER_BYTES_PER_PARAM,
    block_traffic,
    head_traffic,
)
from accelrun.plan.workload import Workload


@dataclass(frozen=True)
class StepTime:
    parts: dict[str, float]  # seconds per optimizer step, by part
    comm_time: dict[str, float]  # seconds the collectives take in all, before any overlap
    rates: DeviceRates

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class _Chunk:
    """Seconds of one chunk on one stage."""

    matmul: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    fsdp_exposed: float = 0.0
    fsdp_total: float = 0.0
    tp: float = 0.0
    pp: float = 0.0
    cp: float = 0.0  # context parallelism's K/V all-gathers and their gradients' reduce-scatters (exposed)
    ep: float = 0.0  # expert parallelism's all-to-alls and its busiest rank's extra expert work (accelrun.plan.moe)

    @property
    def total(self) -> float:
        return (self.matmul + self.attention + self.elementwise + self.fsdp_exposed + self.tp + self.pp + self.cp
                + self.ep)


def estimate_time(w: Workload, cluster: Cluster) -> StepTime:
    rates = cluster.rates(w.precision)
    chunks = {s: _chunk_time(w, cluster, rates, s) for s in stages(w)}
    slowest = max(chunks.values(), key=lambda c: c.total)
    lay = w.layout
    per_flush = lay.pp_microbatches if lay.pp > 1 else 1
    n = w.grad_accum * per_flush  # chunks per optimizer step on one stage
    parts = {
        "matmuls": n * slowest.matmul,
        "attention": n * slowest.attention,
        "elementwise": n * slowest.elementwise,
        "FSDP (exposed)": n * slowest.fsdp_exposed,
        "tensor parallel": n * slowest.tp,
        "context parallel": n * slowest.cp,
        "expert parallel (all-to-all, imbalance)": n * slowest.ep,
        "pipeline send/recv": n * slowest.pp,
        "pipeline bubble": w.grad_accum * bubble_units(lay.pp_schedule, lay.pp, lay.stages_per_rank) * slowest.total,
    }
    p = max(stage_params(w, s).local for s in stages(w)) / (lay.fsdp_shard if lay.fsdp else 1)
    opt_bytes = (OPTIMIZER_BYTES_PER_PARAM[w.optimizer_impl] + (CLIP_BYTES_PER_PARAM if w.grad_clip else 0)) * p
    parts["optimizer"] = opt_bytes / (rates.memory_gbs * 1e9)
    comm = {"FSDP": n * slowest.fsdp_total, "tensor parallel": n * slowest.tp, "pipeline": n * slowest.pp,
            "context parallel": n * slowest.cp, "expert parallel": n * slowest.ep}
    return StepTime({k: v for k, v in parts.items() if v > 0 or k == "matmuls"}, comm, rates)


def _chunk_time(w: Workload, cluster: Cluster, rates: DeviceRates, stage: str) -> _Chunk:
    sh, lay, tp = w.shape, w.layout, w.layout.tp
    tokens = w.chunk_tokens
    p = stage_params(w, stage)
    n_ck = w.checkpointed_layers(p.layers)
    full_recompute = w.ac_mode in ("full", "every_n")
    mem_rate = rates.memory_gbs * 1e9
    c = _Chunk()

    # Matmuls of one block: forward, backward (2x), recompute.
    fwd_mm = recompute_mm = ffn_mm = 0.0
    for i, g in enumerate(sh.block_gemms()):
        k, o = g.local(tp)
        t = 2.0 * tokens * k * o / (rates.matmul_tflops(math.sqrt(k * o)) * 1e12)
        fwd_mm += t
        ffn_mm += t if g.name in ("w1", "w3", "w2") else 0.0
        if full_recompute or (w.ac_mode == "selective" and i % 2 == 1):
            recompute_mm += t
    attn_fwd = 2.0 * tokens * w.seq_len * sh.q_dim / tp / (rates.attention_tflops(w.seq_len, sh.head_dim) * 1e12)
    traffic = block_traffic(w)
    ew_fwd, ew_bwd = tokens * traffic.forward / mem_rate, tokens * traffic.backward / mem_rate
    block_fwd = fwd_mm + attn_fwd + ew_fwd
    block_bwd = 2 * fwd_mm + eff.ATTENTION_BACKWARD_RATIO * attn_fwd + ew_bwd
    block_recompute = recompute_mm + (attn_fwd if full_recompute else 0.0) + ew_fwd

    c.matmul = p.layers * 3 * fwd_mm + n_ck * recompute_mm
    c.attention = p.layers * (1 + eff.ATTENTION_BACKWARD_RATIO) * attn_fwd + (n_ck * attn_fwd if full_recompute else 0)
    c.elementwise = p.layers * (ew_fwd + ew_bwd) + n_ck * ew_fwd
    if stage in ("only", "last"):
        k, o = sh.output_gemm().local(tp)
        c.matmul += 3 * 2.0 * tokens * k * o / (rates.matmul_tflops(math.sqrt(k * o)) * 1e12)
        c.elementwise += tokens * head_traffic(w) / mem_rate
    if w.mode == "autocast":
        c.elementwise += AUTOCAST_CAST_BYTES_PER_PARAM * p.local / mem_rate

    if lay.fsdp:
        _fsdp(c, w, cluster, mem_rate, p, n_ck, block_fwd, block_bwd, block_recompute)
    if tp > 1:
        link = group_link(lay, cluster, "tp")
        act = tokens * sh.dim * w.compute_bytes
        if lay.sequence_parallel:  # all-reduce → reduce-scatter + all-gather
            one = all_gather_s(act, tp, link) + reduce_scatter_s(act, tp, link)
            embedding = reduce_scatter_s(tokens * sh.dim * w.stream_bytes, tp, link)
        else:
            one = all_reduce_s(act, tp, link)
            embedding = all_reduce_s(tokens * sh.dim * w.stream_bytes, tp, link)
        per_block = (2 + 2 + (2 if full_recompute else 0)) * one
        c.tp = p.layers * per_block
        if stage in ("only", "first"):
            c.tp += embedding
        if stage in ("only", "last"):
            logits = (3 * all_reduce_s(4 * tokens, tp, link) if lay.loss_parallel
                      else all_gather_s(tokens * sh.vocab_size * w.compute_bytes, tp, link))
            c.tp += logits + one
    if lay.pp > 1:
        link = group_link(lay, cluster, "pp")
        c.pp = 2 * send_s(tokens * sh.dim * w.stream_bytes, link)
    if lay.cp > 1:  # all-gathered before each attention, so nothing hides it (accelrun.plan.context_parallel)
        c.cp = (p.layers + (n_ck if full_recompute else 0)) * cp_gather_s(w, cluster) + p.layers * cp_reduce_s(w, cluster)
    if ep_of(w) > 1:
        c.ep = expert_parallel_s(w, cluster, 3 * ffn_mm * routed_share(sh), p.layers, n_ck if full_recompute else 0)
    return c


def _fsdp(c: _Chunk, w: Workload, cluster: Cluster, mem_rate: float, p: StageParams, n_ck: int,
          block_fwd: float, block_bwd: float, block_recompute: float) -> None:
    lay = w.layout
    param_bytes = w.compute_bytes if w.mode == "bf16-params" else 4
    # FSDP shards over dp_shard × cp: the outer of the two sets the link.
    shard_link = group_link(lay, cluster, "dp_shard" if lay.dp_shard > 1 else "cp")
    rep_link = group_link(lay, cluster, "dp_replicate")
    n_shard = lay.fsdp_shard

    def gather(n_params: float) -> float:
        return all_gather_s(param_bytes * n_params, n_shard, shard_link) if shard_link else 0.0

    def reduce(n_params: float) -> float:
        t = reduce_scatter_s(4 * n_params, n_shard, shard_link) if shard_link else 0.0
        if rep_link:
            t += all_reduce_s(4 * n_params / n_shard, lay.dp_replicate, rep_link)
        return t

    # Collectives per chunk (module docstring): gathers before forward (fwd) and backward (bwd) of a
    # block, reduce-scatters (rs); the root is gathered once and never resharded in between.
    if lay.pp > 1:
        m = lay.pp_microbatches
        if not lay.reshard_after_forward:  # gathered by the first forward, kept until the flush ends
            fwd, bwd = 1 / m, 0.0
        elif lay.pp_schedule == "gpipe":  # every forward, then the first backward (the rest find it kept)
            fwd, bwd = 1.0, 1 / m
        else:  # 1F1B-like: the forwards before the first backward, then every backward (after a forward)
            fwd, bwd = min(lay.pp, m) / m, 1.0
        rs = root_ag = 1 / m
    else:
        fwd, bwd, rs, root_ag = 1.0, (1.0 if lay.reshard_after_forward else 0.0), 1.0, 1.0
    # FSDP2 copies on the device too: each gather's output is split into the parameters (read and
    # write the gathered bytes), each reduce-scatter's input is the gradients cast to fp32; under
    # pipelining each micro-batch's gradients are added into the fp32 accumulated ones.
    copied = ((fwd + bwd) * 2 * param_bytes + rs * (param_bytes + 4)) * p.layers * p.block
    copied += (root_ag * 2 * param_bytes + rs * (param_bytes + 4)) * p.root
    if lay.pp > 1:
        copied += (1 - rs) * (param_bytes + 8) * p.local
    c.elementwise += copied / mem_rate

    ag_block, rs_block = gather(p.block), rs * reduce(p.block)
    ag_root, rs_root = root_ag * gather(p.root), rs * reduce(p.root)
    regather = bwd * ag_block
    ag_block *= fwd
    total = ag_root + rs_root + p.layers * (ag_block + regather + rs_block)
    c.fsdp_total = total
    if cluster.is_cpu:  # gloo uses the cores that compute: nothing hides
        c.fsdp_exposed = total
        return
    # Forward: root and first block gathered up front; each further gather hides behind a block.
    exposed = ag_root + ag_block + (p.layers - 1) * max(0.0, ag_block - block_fwd)
    # Backward: a block's re-gather and the previous block's reduce-scatter hide behind its compute.
    bwd_compute = block_bwd + (block_recompute if n_ck else 0.0)
    exposed += (p.layers - 1) * max(0.0, regather + rs_block - bwd_compute) + regather + rs_block + rs_root
    c.fsdp_exposed = exposed

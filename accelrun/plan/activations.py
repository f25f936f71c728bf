"""Bytes that autograd keeps for backward, per token, for accelrun's Llama block and head.

Counted, not guessed: the eager figures are what ``torch.autograd.graph.saved_tensors_hooks`` sees
when ``accelrun.models.families.llama.model`` runs one block (distinct storages that grow with the number of
tokens); ``tests/plan/test_plan_activations.py`` counts them again on the real model and must
agree exactly. The compiled figures were counted the same way through ``torch.compile`` (inductor,
torch 2.13): its partitioner keeps fewer tensors and recomputes cheap pointwise ones.

Shapes: D model dim, F feed-forward dim, H query heads (attention's log-sum-exp, one fp32 per
head). Under tensor parallelism (accelrun's Megatron plan) the norms and the inputs of
column-parallel matmuls are replicated on every rank; attention and feed-forward internals are split
``tp`` ways. With ``parallel.sequence_parallel`` (``accelrun.dist.tp``'s SequenceParallel norms) the
norms' tensors and the residual stream are split ``tp`` ways along the sequence too; what stays whole
is what the column-parallel projections save: their input, all-gathered to the full sequence by
DTensor before the matmul (torch keeps that gathered tensor for the weight gradient; Megatron-LM
instead re-gathers it in backward, which accelrun does not). Those inputs are ``SP_GATHERED``.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelrun.plan.workload import Shape, Workload


@dataclass(frozen=True)
class PerToken:
    """Bytes per token of one block: ``replicated`` (every TP rank) and ``sharded`` (split by tp)."""

    replicated: float
    sharded: float

    def local(self, tp: int) -> float:
        return self.replicated + self.sharded / tp


# mode → (replicated: (cD, const), sharded: (cD, cF, cH)); bytes per token per block, nothing
# checkpointed. Replicated: two RMSNorms (fp32 input copy, rsqrt, normalised output) and the inputs
# of the column-parallel matmuls; sharded: q, k, v (keys/values already repeated to all heads),
# attention output, log-sum-exp, and the SwiGLU tensors.
EAGER_SAVED = {
    "fp32": ((24, 8), (16, 16, 4)),
    "autocast": ((26, 8), (8, 8, 4)),  # autocast casts the norm output once per consuming matmul
    "bf16-params": ((16, 8), (8, 8, 4)),
}
COMPILED_SAVED = {
    "fp32": ((16, 8), (16, 12, 4)),
    "autocast": ((10, 8), (8, 6, 4)),
    "bf16-params": ((8, 8), (8, 6, 4)),
}


# mode → bytes per D (per token, per block) of the replicated part above that are the inputs of the
# column-parallel projections (attention's q/k/v, the feed-forward's w1/w3): the two normalised
# inputs in the compute dtype (fp32: 2 × 4; bf16 under FSDP: 2 × 2), or under eager autocast one bf16
# cast per consuming matmul (5 × 2). Under sequence parallelism these stay whole; the rest is split.
SP_GATHERED = {"fp32": 8, "autocast": 10, "bf16-params": 4}
SP_GATHERED_COMPILED = {"fp32": 8, "autocast": 4, "bf16-params": 4}


# Of Inductor's table above, what one Llama block keeps under accelrun's default passes without tensor
# parallelism (merged projections, rematerialisation: the norms' and SwiGLU's outputs are recomputed),
# counted through its compiler on the CPU over grouped-query and plain attention, head dims 16 and 32
# (tests/plan/test_plan_activations.py: 0.70-0.75 in fp32, 0.78-0.85 under autocast). A ratio, not a
# table: which tensors it keeps depends on the shape and the threads (whether q/k/v and w1/w3 merge,
# whether the attention kernel takes the call and reads keys unrepeated), while the share stays near
# these. bf16 parameters under FSDP: not counted.
ACCELRUN_OF_INDUCTOR_SAVED = {"fp32": 0.72, "autocast": 0.81}


def block_saved(shape: Shape, mode: str, compiled: bool, sequence_parallel: bool = False,
                accelrun_defaults: bool = False) -> PerToken:
    """Saved bytes per token of one block with no checkpointing. ``accelrun_defaults``: compiled by
    accelrun with its default passes and no tensor parallelism (``ACCELRUN_OF_INDUCTOR_SAVED``)."""
    (rd, rc), (sd, sf, sh) = (COMPILED_SAVED if compiled else EAGER_SAVED)[mode]
    share = ACCELRUN_OF_INDUCTOR_SAVED.get(mode) if accelrun_defaults and shape.family == "llama" else None
    if share is not None:  # (accelrun_defaults: no tensor parallelism, so no sequence parallelism either)
        inductor = block_saved(shape, mode, compiled=True)
        return PerToken(share * inductor.replicated, share * inductor.sharded)
    # The sharded D-wide tensors are attention's (q, keys and values repeated to all heads, its output):
    # n_heads x head_dim wide, which is D for Llama and not for every family (Gemma 7B: 4096 in 3072).
    sharded = sd * shape.q_dim + sf * shape.ffn_dim + sh * shape.n_heads
    if sequence_parallel:
        whole = (SP_GATHERED_COMPILED if compiled else SP_GATHERED)[mode]
        return PerToken(whole * shape.dim, sharded + (rd - whole) * shape.dim + rc)
    return PerToken(rd * shape.dim + rc, sharded)


def checkpoint_input(w: Workload) -> PerToken:
    """A checkpointed block keeps only its input: the residual stream (replicated under TP, split along
    the sequence under sequence parallelism)."""
    if w.layout.sequence_parallel:
        return PerToken(0.0, w.stream_bytes * w.shape.dim)
    return PerToken(w.stream_bytes * w.shape.dim, 0.0)


def selective_saved(w: Workload) -> PerToken:
    """torchtitan's per-op policy on accelrun's block: the block input, the outputs of the 1st, 3rd,
    5th and 7th matmul (wq, wv, w1, w2; under accelrun's compiler with grouped-query attention, q/k/v
    merged into one: wq+wk+wv, w1, w2), and attention's output and log-sum-exp."""
    s, sh = w.compute_bytes, w.shape
    gemms = sh.block_gemms_merged() if w.merged_projections else sh.block_gemms()
    kept = [g for i, g in enumerate(gemms) if i % 2 == 0]
    rep = w.stream_bytes * sh.dim
    shard = 0.0
    for g in kept:
        if g.split == "col":
            shard += s * g.out_dim
        else:  # a row-parallel output is a full-width partial sum on every rank
            rep += s * g.out_dim
    shard += s * sh.q_dim + 4 * sh.n_heads  # attention's output is n_heads x head_dim wide
    if w.layout.sequence_parallel:  # the block input and the reduce-scattered row-parallel outputs
        return PerToken(0.0, rep + shard)
    return PerToken(rep, shard)


def recomputed(w: Workload) -> PerToken:
    """What backward rebuilds of one checkpointed block before running its backward: the whole block's
    activations, less what the selective policy kept (its outputs beyond the block's input are already
    held, counted in ``layer_saved``)."""
    # Rebuilt whole: what rematerialisation spared the forward from keeping exists again in the backward.
    full = block_saved(w.shape, w.mode, w.compiled, w.layout.sequence_parallel)
    if w.ac_mode != "selective":
        return full
    kept, inp = selective_saved(w), checkpoint_input(w)
    return PerToken(max(0.0, full.replicated - (kept.replicated - inp.replicated)),
                    max(0.0, full.sharded - (kept.sharded - inp.sharded)))


def layer_saved(w: Workload, checkpointed: bool) -> PerToken:
    """What one block keeps between its forward and its backward (under accelrun's rematerialisation,
    less than the block has alive while its backward runs: ``block_saved`` without it)."""
    if not checkpointed:
        return block_saved(w.shape, w.mode, w.compiled, w.layout.sequence_parallel, w.accelrun_defaults)
    if w.ac_mode == "selective":
        return selective_saved(w)
    return checkpoint_input(w)


def loss_bytes_per_logit(w: Workload) -> float:
    """Peak bytes per logit while the loss's backward runs.

    Autograd keeps the log-softmax output (4); the loss's backward writes a dense gradient (4) and
    log-softmax's backward its input gradient (4). Without pipelining, accelrun's training loop also
    keeps the fp32 logits (``logits_BTV``) alive through backward (4 more, ``logits_held_by_loop``);
    a pipeline schedule computes the loss inside itself and holds nothing else. Under bf16 the
    model's bf16 logits are a temporary, gone by then.
    """
    return 12.0 + (4.0 if logits_held_by_loop(w) else 0.0)


def logits_held_by_loop(w: Workload) -> bool:
    return w.layout.pp == 1


def local_logits(w: Workload, tokens: int) -> float:
    """Logits one rank holds: the whole vocabulary on every TP rank (the output layer's logits are
    gathered), or a ``1/tp`` slice under ``parallel.loss_parallel``."""
    return tokens * w.shape.vocab_size / (w.layout.tp if w.layout.loss_parallel else 1)


def head_input_bytes(w: Workload) -> float:
    """Per token, what the last stage's head keeps: the final norm's fp32 input and output (split along
    the sequence under sequence parallelism) and the output layer's input (whole)."""
    norm = 8 * w.shape.dim / (w.layout.tp if w.layout.sequence_parallel else 1)
    return norm + w.compute_bytes * w.shape.dim

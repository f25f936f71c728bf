"""Peak memory of one device for one training step, as a list of named terms.

Static terms live all step: fp32 master weights, fp32 gradients and AdamW's two fp32 moments
(16 bytes per parameter), sharded over ``dp_shard`` by FSDP (replicated over ``dp_replicate``);
FSDP's gathered bf16 copies (the root module, embeddings and output, stays gathered all step; blocks
are gathered two at a time, the one running and the one prefetched, or all of them when
``parallel.reshard_after_forward`` is false); without FSDP, autocast's bf16 copies of the weights,
which autograd keeps for backward.

Dynamic terms: the activations every block keeps for backward (``accelrun.plan.activations``)
times the micro-batches a pipeline stage holds, plus the larger of two moments in backward:

- the loss's backward: logits and their gradients (``loss_bytes_per_logit``), and the output
  layer's gathered gradient under FSDP;
- the first block's backward: its recomputed activations when checkpointed, a working set of
  activation gradients as large as the block's activations, FSDP's unsharded gradient buffers,
  and the fp32 logits accelrun's loop still holds (without pipelining).

Under pipelining with FSDP, torch's ``PipelineStage`` runs every micro-batch's backward but the last
with gradient sync off and without resharding after backward: a block's parameters stay gathered
once its backward has run, and its unsharded gradients accumulate (in fp32, FSDP's reduce dtype)
until the step's last micro-batch reduce-scatters them. Both are charged for the whole stage.

Sequence parallelism splits the norms' tensors and the residual stream along the sequence
(``accelrun.plan.activations``); loss parallelism keeps a ``1/tp`` slice of the logits.

The allocator's reserve (``ALLOCATOR_OVERHEAD``) comes on top of the live tensors; the runtime
(``cluster.reserved_gib``: CUDA context and communicators, or a CPU process's baseline) on top of that.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelrun.plan import efficiency as eff
from accelrun.plan.activations import (
    block_saved,
    head_input_bytes,
    layer_saved,
    local_logits,
    logits_held_by_loop,
    loss_bytes_per_logit,
    recomputed,
)
from accelrun.plan.cluster import Cluster
from accelrun.plan.context_parallel import held_kv_bytes
from accelrun.plan.moe import ep_of, held_params
from accelrun.plan.pipeline import held_by_rank, held_by_stage
from accelrun.plan.workload import Workload

GIB = 2**30


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    detail: str = ""


@dataclass(frozen=True)
class MemoryEstimate:
    terms: list[Term]  # live tensors at the peak, then the allocator's reserve, then the runtime
    stage: str  # which pipeline stage peaks: "only", "first" or "last"
    phase: str  # when: "loss backward" or "first block backward"
    allocator_peak: float  # bytes: live tensors + allocator reserve (what torch's reserved peak reports)
    total: float  # bytes per device: allocator peak + runtime
    capacity: float  # bytes per device

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


@dataclass(frozen=True)
class StageParams:
    layers: int
    block: float  # parameters of one block on one TP rank
    root: float  # embedding / output / final norm held by this stage, per TP rank
    output: float  # of which the output layer's

    @property
    def local(self) -> float:
        return self.layers * self.block + self.root


# Bytes per logit of one chunk of the fused head and loss while it runs: its logits, their fp32 copy or
# the exponentials, and the chunk's gradient (accelrun.compile.fused.linear_cross_entropy).
FUSED_LOSS_BYTES_PER_CHUNK_LOGIT = 16.0


def fused_loss_terms(w: Workload, tokens: int) -> list[Term]:
    """The fused head and loss's peak, in its forward: one chunk's logits at a time, and the gradients it
    computes there and keeps for the backward (the head's input's, in the compute dtype; the output
    weight's, fp32)."""
    rows, vocab, dim = w.fused_loss_rows or 0, w.shape.vocab_size, w.shape.dim
    input_grad, weight_grad = w.compute_bytes * tokens * dim, 4 * vocab * dim
    terms = [
        Term("loss: one chunk's logits (fused)", FUSED_LOSS_BYTES_PER_CHUNK_LOGIT * rows * vocab,
             f"{FUSED_LOSS_BYTES_PER_CHUNK_LOGIT:g} bytes × {rows:,} rows × {vocab:,}: accelrun's "
             "fuse_linear_cross_entropy never holds the whole logits"),
        Term("loss: gradients computed in the forward (fused)", input_grad + weight_grad,
             f"the head's input ({w.compute_bytes} bytes × {tokens:,} × {dim:,}) and the output weight (fp32)"),
    ]
    if rows and tokens > rows:  # several chunks: their sums and pieces (a review: 5 GB short at 128k x 4096)
        # The weight's sum: compiled, each chunk's sum is a new tensor beside the last (AOTAutograd's
        # functional graph writes addmm_ out of place), and under autocast a chunk's part in the
        # compute dtype comes first.
        part = 0 if w.compute_bytes == 4 else w.compute_bytes * vocab * dim
        terms.append(Term("loss: chunks' gradients being summed (fused)", max(weight_grad + part, input_grad),
                          "the weight's running sum beside the next (and a chunk's part under autocast), or "
                          "the input's chunks beside their concatenation, whichever is larger"))
    return terms


def stage_params(w: Workload, stage: str) -> StageParams:
    sh, tp = w.shape, w.layout.tp
    block = sum(g.in_dim * g.out_dim for g in sh.weight_gemms()) / tp + 2 * sh.dim
    first, last = stage in ("only", "first"), stage in ("only", "last")
    output = sh.output_params / tp if last else 0.0
    root = (sh.embedding_params / tp if first else 0.0) + output + (sh.dim if last else 0.0)
    if last and sh.tie_embeddings and not first:  # a last stage of a tied model needs its own copy
        output = root = sh.embedding_params / tp + sh.dim
    return StageParams(w.layers_on(stage), block, root, output)


def stages(w: Workload) -> list[str]:
    """The ranks worth planning: the first (most micro-batches in flight, the embedding), the last (the
    output layer and the loss), and with more than two ranks the busiest one in between."""
    if w.layout.pp == 1:
        return ["only"]
    return ["first", "middle", "last"] if w.layout.pp > 2 else ["first", "last"]


def pipeline_rank(w: Workload, stage: str) -> int:
    lay = w.layout
    if stage in ("only", "first"):
        return 0
    if stage == "last":
        return lay.pp - 1
    return max(range(1, lay.pp - 1), key=lambda r: (lay.rank_layers(r), -r))


def estimate_memory(w: Workload, cluster: Cluster) -> MemoryEstimate:
    """The busiest stage's peak (the larger total when pipelining)."""
    return max((_stage_memory(w, cluster, s) for s in stages(w)), key=lambda m: m.total)


def _stage_memory(w: Workload, cluster: Cluster, stage: str) -> MemoryEstimate:
    lay, sh, tp = w.layout, w.shape, w.layout.tp
    p = stage_params(w, stage)
    shard = lay.fsdp_shard if lay.fsdp else 1
    terms: list[Term] = []
    per_tp = " per TP rank" if tp > 1 else ""
    sharding = f"1/{shard} of {p.local / 1e9:.3g} B{per_tp}" if shard > 1 else f"{p.local / 1e9:.3g} B{per_tp}"
    held = held_params(w, p.local, shard)  # expert parallelism: whole experts, n_experts / ep of them
    if ep_of(w) > 1:
        sharding += f"; experts: 1/{ep_of(w)} (expert parallel)"
    terms.append(Term("parameters (fp32)", 4 * held, sharding))
    terms.append(Term("gradients (fp32)", 4 * held, sharding))
    terms.append(Term("optimizer state (AdamW m, v)", 8 * held, sharding))
    param_bytes = w.compute_bytes if w.mode == "bf16-params" else 4
    pp_fsdp = lay.fsdp and lay.pp > 1
    if pp_fsdp:
        terms.append(Term(
            "gathered parameters (FSDP)", param_bytes * p.local,
            f"the stage's {p.layers} block(s) and root, {param_bytes} bytes each: PipelineStage does not "
            "reshard after backward until the step's last micro-batch"))
        terms.append(Term(
            "accumulated gradients (FSDP, unsharded)", 4 * p.local,
            "fp32, summed over the step's micro-batches; reduce-scattered after the last"))
    elif lay.fsdp:
        gathered_blocks = p.layers if not lay.reshard_after_forward else min(2, p.layers)
        terms.append(Term(
            "gathered parameters (FSDP)", param_bytes * (p.root + gathered_blocks * p.block),
            f"root (embeddings, output) + {gathered_blocks} block(s), {param_bytes} bytes each",
        ))
    elif w.mode == "autocast":
        terms.append(Term("autocast weight copies (bf16)", 2 * p.local, "kept by autograd for backward"))

    tokens = w.chunk_tokens
    n_ck = w.checkpointed_layers(p.layers)
    blocks = tokens * ((p.layers - n_ck) * layer_saved(w, False).local(tp) + n_ck * layer_saved(w, True).local(tp))
    head = tokens * head_input_bytes(w) if stage in ("only", "last") else 0.0  # final norm, the output layer's input
    rank = pipeline_rank(w, stage)
    held = held_by_rank(lay.pp_schedule, lay.pp, lay.pp_microbatches, rank, lay.stages_per_rank)
    if lay.pp > 1 and lay.stages_per_rank > 1 and lay.stage_layers:
        # a looped schedule: each of the rank's stages with its own layers and micro-batches in flight (the
        # head in its last stage only), not the rank's mean stage times all of them
        counts = held_by_stage(lay.pp_schedule, lay.pp, lay.pp_microbatches, rank, lay.stages_per_rank)
        layers = lay.stage_layers[rank::lay.pp]
        held_bytes = sum(n * (blocks * (layers_j / p.layers if p.layers else 0.0)) for n, layers_j in zip(counts, layers, strict=True))
        held_bytes += counts[-1] * head
    else:
        held_bytes = (blocks + head) * held
    policy = {"none": "nothing checkpointed", "full": "every block checkpointed",
              "every_n": f"{n_ck} of {p.layers} blocks checkpointed",
              "selective": "selective (per-op) checkpointing"}[w.ac_mode]
    terms.append(Term("activations", held_bytes,
                      f"{p.layers} blocks, {policy}, {tokens:,} tokens" + (f" × {held:g} in flight" if held != 1 else "")))
    if lay.cp > 1:  # the other ranks' keys and values, gathered for attention and kept for its backward
        kv = held_kv_bytes(w, cluster.is_cpu) * (p.layers - n_ck)
        terms.append(Term("gathered keys/values (context parallel)", kv * held,
                          f"{p.layers - n_ck} blocks × the other {lay.cp - 1} rank(s)' K/V"
                          + ("" if cluster.is_cpu else " (repeated to the query heads) and the float causal masks")))

    block_full = tokens * block_saved(sh, w.mode, w.compiled, lay.sequence_parallel).local(tp)
    layer_phase: list[Term] = []
    if n_ck:
        layer_phase.append(Term("recomputed block", tokens * recomputed(w).local(tp),
                                "one checkpointed block's activations, rebuilt" + (
                                    " (those the selective policy did not keep)" if w.ac_mode == "selective" else "")))
    layer_phase.append(Term("backward working set", eff.BACKWARD_WORKING_SET_OF_BLOCK * block_full,
                            f"activation gradients alive at once: {eff.BACKWARD_WORKING_SET_OF_BLOCK:g} of one "
                            "block's activations"))
    if pp_fsdp:
        layer_phase.append(Term("gradient buffers (FSDP)", param_bytes * p.block,
                                "one block's new gradient before it is added to the accumulated ones"))
    elif lay.fsdp:
        layer_phase.append(Term("gradient buffers (FSDP)", (param_bytes + 4) * p.block + param_bytes * p.output,
                                "one block's unsharded gradients and their fp32 copy for reduce-scatter, "
                                "the output layer's gradient"))
    has_loss = stage in ("only", "last")
    logits = local_logits(w, tokens)
    per_rank = f" (1/{tp} of the vocabulary: loss parallel)" if lay.loss_parallel else ""
    fused = w.fused_loss_rows is not None
    if has_loss and logits_held_by_loop(w) and not fused:
        layer_phase.append(Term("logits (fp32, held by the loop)", 4 * logits, f"{logits:,.0f} logits{per_rank}"))
    loss_phase: list[Term] = []
    if has_loss and fused:
        loss_phase += fused_loss_terms(w, tokens)
    elif has_loss:
        loss_phase.append(Term("loss: logits and gradients", loss_bytes_per_logit(w) * logits,
                               f"{loss_bytes_per_logit(w):g} bytes × {logits:,.0f} logits{per_rank}"))
        if lay.fsdp:
            loss_phase.append(Term("gradient buffers (FSDP)", param_bytes * p.output, "the output layer's gradient"))
    loss_phase_name = "loss (fused, in the forward)" if fused else "loss backward"
    phase_name, phase_terms = max(((loss_phase_name, loss_phase), ("first block backward", layer_phase)),
                                  key=lambda x: sum(t.bytes for t in x[1]))
    terms += phase_terms

    live = sum(t.bytes for t in terms)
    reserve = live * eff.ALLOCATOR_OVERHEAD
    terms.append(Term("allocator reserve", reserve, f"ALLOCATOR_OVERHEAD {eff.ALLOCATOR_OVERHEAD:g} of live tensors"))
    runtime = cluster.reserved_gib * GIB
    terms.append(Term("runtime (not tensors)", runtime, "cluster.reserved_gib"))
    return MemoryEstimate(terms, stage, phase_name, live + reserve, live + reserve + runtime,
                          cluster.memory_gib * GIB)

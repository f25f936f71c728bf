"""What one training step asks of each device: the model's shape, the layout, the batch, the options.

Torch-free on purpose (``accelrun plan`` must run where torch is not installed), so the shape
arithmetic is restated here; each model family's torch-free ``shape`` module
(``accelrun.models.families.<name>.shape``) turns a recipe's ``model`` section into a :class:`Shape`,
and ``tests/plan/test_plan_workload.py`` keeps its counts equal to the family's for every shipped
model recipe.

Precision modes, as accelrun trains them (``accelrun/train``, ``accelrun/dist/fsdp.py``):

- ``fp32``: everything in fp32.
- ``autocast``: bf16-mixed without FSDP: fp32 weights, ``torch.autocast`` casts each matmul's operands
  to bf16; the residual stream stays fp32.
- ``bf16-params``: bf16-mixed with FSDP (any data parallelism): FSDP2 gathers bf16 copies of the
  weights (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); the residual stream is bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from accelrun.config.compile_names import PassConfigError, parse_passes
from accelrun.config.schema import RunConfig
from accelrun.errors import UserError
from accelrun.plan.model_shape import Gemm, Shape  # noqa: F401  (re-exported: planners import them from here)

AC_MODES = ("none", "full", "every_n", "selective")  # train.activation_checkpoint.mode's values


@dataclass(frozen=True)
class Layout:
    nnodes: int
    nproc_per_node: int
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp_schedule: str
    pp_microbatches: int
    reshard_after_forward: bool
    sequence_parallel: bool = False  # TP: norms and the residual stream sharded along the sequence
    loss_parallel: bool = False  # TP: logits stay sharded over the vocabulary through the loss
    stage_layers: tuple[int, ...] = ()  # layers of each pipeline stage (pp × stages per rank); () = no pipeline
    cp: int = 1  # context parallelism: each sequence split over cp ranks (accelrun.plan.context_parallel)
    ep: int = 1  # expert parallelism: experts spread over ep of the dp_shard ranks (accelrun.plan.moe)

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        # accelrun applies FSDP2 whenever there is data (or context) parallelism (HSDP when dp_replicate > 1).
        return self.dp * self.cp > 1

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards parameters over: dp_shard × cp (context-parallel ranks reduce gradients too)."""
        return self.dp_shard * self.cp

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank runs (``parallel.pp_stages_per_rank`` or the schedule's default)."""
        return len(self.stage_layers) // self.pp if self.stage_layers else 1

    def rank_layers(self, rank: int) -> int:
        """Blocks pipeline rank ``rank`` runs: its stages are ``rank``, ``rank + pp``, ... (looped schedules)."""
        return sum(self.stage_layers[rank::self.pp]) if self.stage_layers else 0


@dataclass(frozen=True)
class Workload:
    shape: Shape
    layout: Layout
    seq_len: int
    micro_batch: int  # per data-parallel rank, per accumulation step
    grad_accum: int
    global_batch: int
    precision: str  # fp32 | bf16-mixed
    ac_mode: str  # none | full | every_n | selective
    every_n: int
    compiled: bool
    optimizer_impl: str  # fused | foreach | for_loop
    on_cpu: bool
    grad_clip: bool = True  # train.grad_clip set (clipping reads and scales every gradient)
    # accelrun's merge_parallel_linears runs (on plain, unsharded weights): selective checkpointing then
    # counts the merged matmuls (Shape.block_gemms_merged)
    merged_projections: bool = False
    # Rows per chunk of the fused output projection and loss (accelrun's fuse_linear_cross_entropy under
    # compile.scope loss): the (tokens, vocabulary) logits never exist whole. None: the loss is unfused.
    fused_loss_rows: int | None = None
    # accelrun's compiler with the passes whose saved tensors the plan counted (merged projections and
    # rematerialisation, no tensor parallelism): plan/activations.py's ACCELRUN_OF_INDUCTOR_SAVED.
    accelrun_defaults: bool = False

    @property
    def mode(self) -> str:
        """Numerics mode (module docstring): fp32, autocast or bf16-params."""
        if self.precision == "fp32":
            return "fp32"
        return "bf16-params" if self.layout.fsdp else "autocast"

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def stream_bytes(self) -> int:
        """Bytes per element of the residual stream between blocks."""
        return 2 if self.mode == "bf16-params" else 4

    @property
    def chunk_batch(self) -> int:
        """Sequences in one pipeline micro-batch (the whole micro-batch without pipelining)."""
        return self.micro_batch // self.layout.pp_microbatches if self.layout.pp > 1 else self.micro_batch

    @property
    def chunk_tokens(self) -> int:
        """Tokens one rank runs per forward: its chunks' share of the sequences under context parallelism."""
        return self.chunk_batch * self.seq_len // self.layout.cp

    @property
    def chunks_per_step(self) -> int:
        """Forward+backward passes of one stage per optimizer step."""
        return self.grad_accum * (self.layout.pp_microbatches if self.layout.pp > 1 else 1)

    @property
    def tokens_per_device_step(self) -> int:
        """Tokens one data-parallel rank contributes per optimizer step."""
        return self.micro_batch * self.grad_accum * self.seq_len

    @property
    def layers_per_stage(self) -> int:
        """Blocks of the busiest pipeline rank (all of them without pipelining)."""
        lay = self.layout
        if lay.pp <= 1:
            return self.shape.n_layers
        return max(lay.rank_layers(r) for r in range(lay.pp))

    def layers_on(self, stage: str) -> int:
        """Blocks a rank runs: ``only`` (no pipeline), ``first``, ``last``, or ``middle`` (the busiest of the
        ranks in between)."""
        lay = self.layout
        if stage == "only":
            return self.shape.n_layers
        if stage == "first":
            return lay.rank_layers(0)
        if stage == "last":
            return lay.rank_layers(lay.pp - 1)
        return max(lay.rank_layers(r) for r in range(1, lay.pp - 1))

    def checkpointed_layers(self, n: int | None = None) -> int:
        """Of ``n`` blocks (default: the busiest rank's), those whose activations are recomputed
        (selective counts as all)."""
        n = self.layers_per_stage if n is None else n
        if self.ac_mode in ("full", "selective"):
            return n
        if self.ac_mode == "every_n":
            return math.ceil(n / self.every_n)  # blocks i with i % every_n == 0
        return 0


@dataclass(frozen=True)
class PlanOptions:
    """What the planner assumes beyond the recipe.

    ``activation_checkpoint``: model another checkpointing policy than the recipe's (a what-if;
    ``selective`` is torchtitan's per-op policy, which ``train.activation_checkpoint.mode`` selects too:
    keep the outputs of every second matmul and of attention, recompute the rest).
    """

    activation_checkpoint: str | None = None


def workload_from_config(cfg: RunConfig, options: PlanOptions | None = None) -> Workload:
    """The step a validated recipe describes. Raises ``UserError`` for what cannot be planned."""
    options = options or PlanOptions()
    m, t, par = cfg.model, cfg.train, cfg.parallel
    if m.custom is not None:
        raise UserError(
            f"model.custom = {m.custom!r}: accelrun plan models the built-in model families only "
            "(it needs the model's shape to count memory, FLOPs and traffic)"
        )
    deg = par.degrees()
    pp = deg["pp"]
    stage_layers: tuple[int, ...] = ()
    if pp > 1:  # the split accelrun.dist.pipeline makes: pp_layers, or balanced with the ends counted
        from accelrun.plan.stage_split import recipe_stage_layers

        stage_layers = recipe_stage_layers(cfg)
    tp_on = deg["tp"] > 1
    layout = Layout(
        nnodes=par.nnodes, nproc_per_node=par.nproc_per_node, pp=pp, dp_replicate=deg["dp_replicate"],
        dp_shard=deg["dp_shard"], tp=deg["tp"], cp=deg["cp"], pp_schedule=par.pp_schedule,
        pp_microbatches=(par.microbatches or pp),
        # Compiled FSDP saves the gathered parameters for backward: reshard_after_forward false's memory
        # and gathers (accelrun.dist.compiled_fsdp).
        reshard_after_forward=par.reshard_after_forward and par.fsdp_impl != "compiled",
        sequence_parallel=par.sequence_parallel and tp_on, loss_parallel=par.loss_parallel and tp_on,
        stage_layers=stage_layers, ep=par.ep,
    )
    ac = options.activation_checkpoint or t.activation_checkpoint.mode
    if ac not in AC_MODES:
        raise UserError(f"activation checkpointing {ac!r}: expected one of {', '.join(AC_MODES)}")
    from accelrun.models.families import plan_shape  # torch-free: the family's shape module

    shape = plan_shape(m)
    on_cpu = cfg.cluster.device == "cpu"
    impl = t.optimizer.impl
    if impl == "auto":  # as accelrun.train.optim: fused, except sharded parameters on a CPU
        impl = "foreach" if (on_cpu and layout.world > 1) else "fused"
    return Workload(
        shape=shape, layout=layout, seq_len=t.seq_len, micro_batch=t.micro_batch, grad_accum=cfg.grad_accum,
        global_batch=t.global_batch, precision=t.precision, ac_mode=ac, every_n=t.activation_checkpoint.every_n,
        compiled=cfg.compile.backend != "eager", optimizer_impl=impl, on_cpu=on_cpu, grad_clip=bool(t.grad_clip),
        merged_projections=_merges_projections(cfg, layout),
        fused_loss_rows=_fused_loss_rows(cfg, layout, shape.vocab_size),
        accelrun_defaults=_merges_projections(cfg, layout) and _passes_on(cfg) >= {"remat"},
    )


def _passes_on(cfg: RunConfig) -> set[str]:
    try:
        return {name for name, _ in parse_passes(cfg.compile.passes)}
    except PassConfigError:
        return set()


def _fused_loss_rows(cfg: RunConfig, layout: Layout, vocab: int) -> int | None:
    """Rows per chunk where accelrun fuses the head with the loss, as ``resolve_scope`` and the pass decide:
    the accelrun backend, scope ``auto`` or ``loss``, the pass listed. Planned as unfused under tensor
    parallelism (a DTensor head) and pipelining (the schedule computes the loss), where it is not checked."""
    c = cfg.compile
    if c.backend != "accelrun" or c.scope not in ("auto", "loss") or layout.tp > 1 or layout.pp > 1:
        return None
    try:
        options = dict(parse_passes(c.passes)).get("fuse_linear_cross_entropy")
    except PassConfigError:
        return None
    if options is None:
        return None
    rows = cfg.train.micro_batch * cfg.train.seq_len // layout.cp
    chunk = options.chunk_rows or max(1, int(options.chunk_mb * 2**20) // (vocab * 4))  # as the pass derives it
    return min(chunk, rows)


def _merges_projections(cfg: RunConfig, layout: Layout) -> bool:
    if cfg.compile.backend != "accelrun" or layout.tp > 1:  # a DTensor weight is left unmerged
        return False
    return "merge_parallel_linears" in _passes_on(cfg)


def with_layout(w: Workload, **changes) -> Workload:
    return replace(w, layout=replace(w.layout, **changes))

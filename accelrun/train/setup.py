"""Build everything one training process needs, from a resolved recipe: device, model, data,
optimizer, schedule, compile and checkpointing policy, the MFU peak, and the resume point."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from accelrun.compile.compile_model import Compiled
from accelrun.config import ConfigError, ResolvedConfig, RunConfig
from accelrun.config.preflight import custom_model_key, ids_the_logits_cover
from accelrun.data import build_data
from accelrun.data.build import build_eval_data
from accelrun.dist.comm_overlap import comm_trace_for
from accelrun.dist.comm_timing import comm_timer_for
from accelrun.dist.context import ParallelContext
from accelrun.dist.context_parallel import ContextParallelStats, ContextShardedBatches, context_parallel_loss
from accelrun.dist.expert_parallel import apply_expert_parallel
from accelrun.dist.layout import apply_layout
from accelrun.dist.pipeline import Pipeline, microbatch_loss, union_of
from accelrun.dist.tp import loss_context
from accelrun.errors import DataError
from accelrun.models import build_model, model_summary
from accelrun.models.build import (
    ModelBuildError,
    data_vocab,
    document_packing_problem,
    loss_source,
    materialize_local,
    parameters_not_float32,
    position_table_problem,
    targets_not_passed,
    training_loss_fn,
)
from accelrun.models.flop_count import FlopsPerToken, ModelSizesDisagree, flops_per_token
from accelrun.models.hf_io import load_hf_for_config
from accelrun.plan.stage_split import recipe_end_costs
from accelrun.report.peak import Peak, resolve_peak
from accelrun.train.checkpoint import complete_checkpoints, load_checkpoint, remove_partial, restore_rng_state
from accelrun.train.lineage import RunAlreadyContinued, claim_continuation
from accelrun.train.model_code import code_changes, model_code
from accelrun.train.optim import build_optimizer, build_scheduler, keep_recipe_settings, recipe_settings
from accelrun.train.resume import ResumeDecision, auto_would_continue, decide_resume, training_differences


@dataclass
class TrainSetup:
    config: RunConfig
    training_hash: str
    device: torch.device
    ctx: ParallelContext
    model: nn.Module  # under pipeline parallelism: the union of this rank's stages
    pipeline: Pipeline | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data: Any  # accelrun.data iterator: next() -> (inputs_BT, targets_BT), state_dict()
    grad_accum: int
    tokens_per_step: int
    flops: FlopsPerToken  # training FLOPs per token, and how they were found or why they are unknown
    peak: Peak
    compiles: bool
    compiled: str
    # (label, accelrun's CompileRecord) of each part compiled on this rank: one under pipeline parallelism
    # per stage ("stage0", "stage2": interleaved schedules give a rank several); empty without accelrun.
    compile_parts: list[tuple[str, Any]]
    # (inputs, targets[, positions]) -> mean loss; positions under data.packing = document
    loss_fn: Callable[..., torch.Tensor]
    checkpoint_dir: Path
    start_step: int
    resumed_from: Path | None
    resume_reason: str
    model_info: dict[str, Any]
    # Seconds this rank has spent blocked in collectives (CPU ranks of a job; accelrun.dist.comm_timing).
    comm_timer: Any = None
    # () -> the context the loss's forward and backward run in (parallel.loss_parallel), else a no-op.
    loss_context: Callable[[], Any] = contextlib.nullcontext
    # Which loss training minimises (models.build.LossSource), read from the whole model before it is
    # split into stages (a stage, or their union, has no forward of the model's).
    loss_source: Any = None
    # What the model does that its recipe does not say (targets under a name training does not pass,
    # parameters of another dtype), said at the start and in the report.
    model_notes: list[str] = field(default_factory=list)
    # Exposed and overlapped communication of FSDP's and compiled graphs' collectives (accelrun.dist.comm_overlap).
    comm_trace: Any = None
    # eval.every > 0: this rank's held-out batches (accelrun.data.heldout), else None.
    eval_data: Any = None
    # parallel.ep > 1: the experts' placement; its reduce_gradients() runs after each step's backward.
    expert_parallel: Any = None
    # parallel.cp > 1: what this rank's context-parallel attention exchanged (accelrun.dist.context_parallel).
    cp_stats: Any = None
    # module -> digest of the files that define a user model's classes (train.model_code), saved with checkpoints.
    model_code: dict[str, str] | None = None
    tokenizer_name: str | None = None  # the tokenizer the data was encoded with (its token file header's name)

    @property
    def compile_record(self) -> Any:
        """accelrun's CompileRecord of everything this rank compiled (every stage), or None. Merged when
        read: the stages compile lazily, in the first step."""
        if not self.compile_parts:
            return None
        from accelrun.compile.record import merge_records

        return merge_records(self.compile_parts)

    def train_state(self) -> dict[str, Any]:
        """What a checkpoint needs besides tensors; JSON-able."""
        return {
            "training_hash": self.training_hash,
            "data": self.data.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "model_code": self.model_code or {},
            # which tokenizer's ids the model learned ("byte", or a tokenizer.json's hf-<hash>): generate
            # refuses to decode them with a file that has changed since
            "tokenizer": self.tokenizer_name,
        }


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda, but no CUDA device is available here (use auto or cpu)")
    return torch.device(requested)


def tokenizer_of(data_cfg: Any) -> Any:
    """The tokenizer ``data.tokenizer`` names (None for data that is not text: synthetic ids, a token file)."""
    from accelrun.data.tokenizer import get_tokenizer

    name = getattr(data_cfg, "tokenizer", None)
    if not isinstance(name, str) or name == "hf":
        return None
    try:
        return get_tokenizer(name)
    except Exception:  # noqa: BLE001 (the data's own build says what is wrong with it)
        return None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _describe(compiled: list[Compiled], labels: list[str]) -> str:
    """What was compiled, for the log and the report: once if every part says the same, else per part."""
    descriptions = [c.description for c in compiled]
    if len(set(descriptions)) == 1:
        return descriptions[0] + (f" (in each of {len(compiled)} stages)" if len(compiled) > 1 else "")
    return "; ".join(f"{label}: {d}" for label, d in zip(labels, descriptions, strict=True))


def _local_loss(loss_fn):
    """Under loss parallel the loss is a replicated DTensor; the loop accumulates plain tensors.
    (``to_local`` keeps the autograd graph: backward still runs through the sharded loss.)"""
    from torch.distributed.tensor import DTensor

    def loss(inputs_BT: torch.Tensor, targets_BT: torch.Tensor, *positions: torch.Tensor) -> torch.Tensor:
        value = loss_fn(inputs_BT, targets_BT, *positions)
        return value.to_local() if isinstance(value, DTensor) else value

    return loss


def _decide(resume: str, run_dir: Path, training_hash: str, restart_count: int) -> ResumeDecision:
    if restart_count > 0:
        # The elastic agent restarted the group after a failure: continue this run's own work.
        own = complete_checkpoints(run_dir / "checkpoints")
        if own:
            return ResumeDecision(own[-1], f"restart {restart_count} of the group after a failure")
    return decide_resume(resume, run_dir.parent, run_dir, training_hash)


def _decide_and_claim(resume: str, run_dir: Path, training_hash: str,
                      restart_count: int) -> ResumeDecision | RunAlreadyContinued:
    """The checkpoint to resume from; continuing another run folder's claims it (lineage.py), so two
    identical commands started together cannot both continue it. A checkpoint named in the recipe
    (``checkpoint.resume: <folder>``) is a continuation too where ``auto`` would have taken it; any other
    (an older step, another training, a run elsewhere) starts a new run, and its folder stays as it was."""
    decision = _decide(resume, run_dir, training_hash, restart_count)
    ckpt = decision.checkpoint
    continues = resume == "auto" or (resume != "none" and ckpt is not None and auto_would_continue(ckpt, run_dir,
                                                                                                  training_hash))
    if ckpt is not None and continues and ckpt.run_dir != run_dir:
        try:
            claim_continuation(ckpt.run_dir, run_dir, ckpt.step)
        except RunAlreadyContinued as e:
            return e
        except OSError as e:  # a folder this process may not write in: the run goes on, unlinked
            decision = ResumeDecision(ckpt, f"{decision.reason}; not linked to {ckpt.run_dir} ({e.strerror})")
    return decision


def _first_line(e: BaseException) -> str:
    # DCP wraps each rank's error; show the first underlying one.
    failures = getattr(e, "failures", None)
    if failures:
        e = getattr(next(iter(failures.values())), "exc", e)
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def build_setup(resolved: ResolvedConfig, run_dir: Path, ctx: ParallelContext | None = None) -> TrainSetup:
    """Everything one process needs. ``ctx`` is this rank's place in a multi-process job (None: alone)."""
    cfg = resolved.config
    t = cfg.train
    ctx = ctx or ParallelContext.single(pick_device(t.device))
    device = ctx.device
    seed_everything(t.seed)

    # A model family's model is built on the meta device; each rank applies its layout (stages, TP, FSDP)
    # and then allocates and initialises only what it holds (materialize_local). Values are keyed by
    # parameter name and position (models.shard_init), so the sharded job starts from exactly the
    # weights a single process would. A user's model is built whole on the device, as its factory does.
    on_meta = cfg.model.custom is None
    try:
        model = build_model(cfg.model, "meta" if on_meta else device, seed=t.seed)
    except ModelBuildError as e:  # with the recipe's line that named it, as validate says it
        if cfg.model.custom is None:
            raise
        raise ConfigError([f"{m}{custom_model_key(e, resolved.sources)}" for m in e.messages]) from e
    info = model_summary(cfg.model, model)  # its FLOPs per token: flop_count's, added below
    # A user's model's classes (a family's are accelrun's), read before a layout splits or wraps the model.
    code = model_code(model) if cfg.model.custom is not None else {}
    if cfg.data.packing == "document" and (problem := document_packing_problem(model)) is not None:
        raise ConfigError(problem)
    if cfg.model.custom is not None and (problem := position_table_problem(model, t.seq_len)) is not None:
        raise ConfigError(problem)
    # Before compile and layouts: a user's model is counted by running its forward once, whole.
    try:
        flops = flops_per_token(cfg.model, t.seq_len, model, device, data_vocab(cfg.model, model)[0], t.micro_batch)
    except ModelSizesDisagree as e:  # as validate says it, with where the recipe names the model
        raise ConfigError(f"{e}{custom_model_key(e, resolved.sources)}") from e
    info.update(flops_per_token=flops.value, flops_source=flops.source)
    trained_loss = loss_source(model)
    model_notes = [n for n in (targets_not_passed(model), parameters_not_float32(model, t.precision)) if n]
    pipeline = None
    parts, labels = [model], ["model"]
    vocab_parallel = cfg.parallel.loss_parallel and ctx.tp_size > 1
    if ctx.mesh is not None and ctx.pp_size > 1:
        pipeline = Pipeline(model, ctx.mesh, cfg.parallel.pp_schedule, cfg.parallel.microbatches or ctx.pp_size,
                            microbatch_loss(cfg.grad_accum), device, layers=cfg.parallel.pp_layers,
                            stages_per_rank=cfg.parallel.stages_per_rank,
                            vocab_parallel=vocab_parallel, ends=recipe_end_costs(cfg))
        parts, labels = pipeline.modules, [f"stage{s}" for s in pipeline.stage_ids]
    # Before compile and FSDP: each rank keeps its experts, which FSDP then leaves alone.
    expert_parallel = (apply_expert_parallel(model, ctx.mesh, cfg.parallel.ep, ctx.dp_size)
                       if ctx.mesh is not None and cfg.parallel.ep > 1 else None)
    cp_stats = ContextParallelStats() if ctx.cp_size > 1 else None
    # Every part's: an interleaved schedule gives a rank several stages, each compiled by its own backend.
    compiled = [apply_layout(part, cfg, ctx, run_dir / "compile", cp_stats) for part in parts]
    if on_meta:
        for part in parts:
            materialize_local(part, device, seed=t.seed)
        if cfg.model.hf is not None:  # a Hugging Face checkpoint's weights replace the initial ones
            load_hf_for_config(parts, cfg.model)
    if pipeline is not None:
        pipeline.build_schedule()

    if pipeline is not None:
        model = union_of(parts)  # this rank's stages under the whole model's parameter names
    optimizer = build_optimizer(model, t.optimizer, device, sharded=ctx.distributed)
    scheduler = build_scheduler(optimizer, t.lr_schedule, t.steps)
    vocab_size, custom = data_vocab(cfg.model, model)  # a user's model: its token table's rows
    data = build_data(
        cfg.data, seq_len=t.seq_len, micro_batch=t.micro_batch, seed=t.seed,
        vocab_size=vocab_size, custom=custom, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, eval_cfg=cfg.eval,
    )
    # (under loss parallelism each rank's logits hold its share of the vocabulary: not checked against all of it)
    loss_fn = (_local_loss(training_loss_fn(model)) if vocab_parallel
               else training_loss_fn(model, ids_the_logits_cover(cfg, vocab_size)))
    if cp_stats is not None:  # this rank's chunks of the dp rank's sequences; the loss over the whole of them
        cp_mesh = ctx.mesh["cp"]
        data = ContextShardedBatches(data, cp_mesh.get_local_rank(), ctx.cp_size)
        loss_fn = context_parallel_loss(loss_fn, cp_mesh.get_group(), ctx.cp_size)
    eval_data = None
    if cfg.eval.every > 0:  # not under pipelining: the recipe's validation refuses it (config/validate.py)
        eval_data = build_eval_data(
            cfg.data, cfg.eval, seq_len=t.seq_len, micro_batch=t.micro_batch, seed=t.seed,
            vocab_size=vocab_size, custom=custom, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
        )

    checkpoint_dir = run_dir / "checkpoints"
    # One rank decides (it reads the file system), every rank follows: they must load the same one.
    decision: ResumeDecision | RunAlreadyContinued = ctx.broadcast_object(
        _decide_and_claim(cfg.checkpoint.resume, run_dir, resolved.training_hash, ctx.restart_count)
        if ctx.is_main else None
    )
    if isinstance(decision, RunAlreadyContinued):  # every rank stops with the same message
        raise decision
    start_step, resumed_from, reason = 0, None, decision.reason
    if decision.checkpoint is not None:
        ckpt = decision.checkpoint
        if ctx.is_main:
            remove_partial(ckpt.path.parent)
        built = recipe_settings(optimizer)
        try:
            saved = load_checkpoint(ckpt.path, model, optimizer)
        except (CheckpointException, RuntimeError, KeyError, ValueError) as e:
            raise ConfigError(
                f"checkpoint.resume: {ckpt.path} does not fit this recipe's model or optimizer "
                f"(written with training hash {ckpt.training_hash}, this run's is {resolved.training_hash}): "
                f"{_first_line(e)}"
            ) from None
        scheduler.load_state_dict(saved["scheduler"])
        if changed := keep_recipe_settings(optimizer, scheduler, built):
            reason += f"; note: the optimizer goes on with this recipe's settings ({', '.join(changed)})"
        try:
            data.load_state_dict(saved["data"])
        except DataError:
            # Another training from its checkpoint (a fine-tune, or the same recipe on new data) is a new run
            # with its own recipe: its data from the start. It was refused, and the only way offered,
            # checkpoint.resume=none, left the weights behind (a trial's). A continuation's data must match.
            if ckpt.training_hash == resolved.training_hash:
                raise
            reason += "; note: its data position is in other data than this run's, which is read from its start"
        start_step, resumed_from = int(saved["step"]), ckpt.path
        # Last in setup: nothing above may draw from the generators after this (the model's init did before).
        if (missing := restore_rng_state(ckpt.path, ctx.rank, ctx.world_size)) is not None:
            reason += f"; note: {missing}"
        if changed := code_changes(saved.get("model_code") or code, code):  # (an older checkpoint: none said)
            reason += (f"; note: the model's code changed since {ckpt.path.name} was written ({', '.join(changed[:3])}"
                       f"{' and more' if len(changed) > 3 else ''}): its weights go on with the new code, so the losses "
                       "will not continue the old curve (checkpoint.resume=none starts afresh)")
        if ckpt.training_hash != resolved.training_hash:
            # Which values differ, and "may": a layout alone changes only the order of sums (a trial's FSDP
            # checkpoint resumed on one rank matched to 1.4e-7, where the note said they would not match).
            differ = training_differences(ckpt.run_dir / "config.yaml", run_dir / "config.yaml")
            which = f" ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})" if differ else ""
            reason += (f"; note: written with training hash {ckpt.training_hash}, this run's is "
                       f"{resolved.training_hash}{which}, so the losses may differ from a continuous run's (by "
                       "rounding only, where only the parallel layout changed)")

    return TrainSetup(
        config=cfg,
        training_hash=resolved.training_hash,
        device=device,
        ctx=ctx,
        model=model,
        pipeline=pipeline,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        grad_accum=cfg.grad_accum,
        # This device's share of the step's tokens (TP ranks share theirs): global / world size.
        tokens_per_step=t.global_batch * t.seq_len // ctx.world_size,
        flops=flops,
        peak=resolve_peak(device, t.precision, cfg.report.peak_tflops),
        compiles=cfg.compile.backend != "eager",
        compiled=_describe(compiled, labels),
        compile_parts=[(label, c.record) for label, c in zip(labels, compiled, strict=True) if c.record is not None],
        loss_fn=loss_fn,
        loss_source=trained_loss,
        model_notes=model_notes,
        checkpoint_dir=checkpoint_dir,
        start_step=start_step,
        resumed_from=resumed_from,
        resume_reason=reason,
        model_info=info,
        comm_timer=comm_timer_for(ctx.world_size, device),
        comm_trace=comm_trace_for(ctx.world_size, device),
        loss_context=lambda: loss_context(vocab_parallel),
        eval_data=eval_data,
        expert_parallel=expert_parallel,
        cp_stats=cp_stats,
        model_code=code,
        tokenizer_name=getattr(tokenizer_of(cfg.data), "name", None),
    )

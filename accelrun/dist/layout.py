"""Apply a recipe's parallel layout to one model or pipeline stage: the one place that knows the order.

Training (``accelrun.train.setup``) and the dry run (``accelrun.dist.dry_run``) both call
``apply_layout``, so the layout a dry run counts is the one a job trains with.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from accelrun.compile.compile_model import (
    Compiled,
    checkpointed_blocks,
    compile_model,
    no_blocks_to_checkpoint,
)
from accelrun.config import ConfigError, RunConfig
from accelrun.dist.activation_checkpoint import apply_activation_checkpointing
from accelrun.dist.async_tp import enable_async_tp
from accelrun.dist.context import ParallelContext
from accelrun.dist.context_parallel import ContextParallelStats, apply_context_parallel
from accelrun.dist.float8 import convert_to_float8
from accelrun.dist.fsdp import apply_fsdp
from accelrun.dist.pipeline import receive_sequence_shards
from accelrun.dist.tp import apply_tp
from accelrun.models import transformer_blocks
from accelrun.models.build import family_spec


def apply_layout(part: nn.Module, cfg: RunConfig, ctx: ParallelContext, dump_dir: Path,
                 cp_stats: ContextParallelStats | None = None) -> Compiled:
    """TP, context parallelism, activation checkpointing, compile, then FSDP/HSDP (or compiled FSDP,
    which compiles and shards in one step), in place on ``part``; returns what was compiled.

    The order is what each step needs: TP and context parallelism rewrite the blocks the compiler then
    traces (with their collectives); checkpointing wraps a block's forward before it is compiled; FSDP
    shards the parameters of the compiled modules last.
    """
    t = cfg.train
    blocks = transformer_blocks(part)
    if t.float8:  # first: TP, compile and FSDP then see the float8 layers, as in torchtitan
        convert_to_float8(part)
    if ctx.mesh is not None and ctx.tp_size > 1:
        spec = family_spec(cfg.model)
        apply_tp(part, ctx.mesh["tp"], sequence_parallel=cfg.parallel.sequence_parallel,
                 loss_parallel=cfg.parallel.loss_parallel, plan=spec.tp_plan)
        if cfg.parallel.async_tp:  # before compile: Inductor reads the flag as it compiles
            enable_async_tp(ctx.mesh["tp"])
        if cfg.parallel.sequence_parallel and ctx.pp_size > 1:  # stages pass on sequence shards
            receive_sequence_shards(part, spec, ctx.tp_size)
    if ctx.mesh is not None and ctx.cp_size > 1:  # before compile: the blocks compile with its collectives
        apply_context_parallel(part, cfg.model, ctx.mesh, cp_stats, 2 if t.precision == "bf16-mixed" else 4)
    if t.activation_checkpoint.mode != "none":
        found = checkpointed_blocks(part, blocks)
        if found is None:
            raise ConfigError(no_blocks_to_checkpoint(part))
        wrapped = apply_activation_checkpointing(found, t.activation_checkpoint)
        # said with what compiled (the run's first lines, report.md): a run never said it checkpointed
        checkpointed = (f"activation checkpointing ({t.activation_checkpoint.mode}) on {wrapped} of {len(found)} "
                        f"{type(found[0]).__name__} blocks")
    else:
        checkpointed = ""
    if cfg.parallel.fsdp_impl == "compiled" and ctx.mesh is not None and ctx.dp_size > 1:
        from accelrun.dist.compiled_fsdp import compile_sharded

        return _with_checkpointing(
            with_cuda_graph_decision(compile_sharded(part, blocks, ctx.mesh, cfg.compile, dump_dir), cfg, ctx),
            checkpointed)
    compiled = with_cuda_graph_decision(
        compile_model(part, blocks, cfg.compile, dump_dir, loss_parallel=cfg.parallel.loss_parallel,
                      # one process only: a sharded model compiled whole is a layout nothing here tests
                      precision=t.precision if ctx.mesh is None else None), cfg, ctx)
    if ctx.mesh is not None and ctx.dp_size * ctx.cp_size > 1:  # cp ranks' gradients are reduced as dp's
        apply_fsdp(part, blocks, ctx.mesh, t.precision, cfg.parallel.reshard_after_forward)
    return _with_checkpointing(compiled, checkpointed)


def _with_checkpointing(compiled: Compiled, checkpointed: str) -> Compiled:
    if checkpointed:
        compiled.description += f"; {checkpointed}"
    return compiled


def with_cuda_graph_decision(compiled: Compiled, cfg: RunConfig, ctx: ParallelContext) -> Compiled:
    """compile.cuda_graphs decided for the run (device, ranks, data) before the first graph compiles
    (they compile at the first call); each graph then decides for itself (accelrun.compile.cuda_graphs)."""
    if compiled.record is not None:
        decide_cuda_graphs(compiled.record, cfg, ctx.device.type, ctx.world_size)
    return compiled


def decide_cuda_graphs(record, cfg: RunConfig, device_type: str, ranks: int, backend: str | None = None) -> None:
    """The run's compile.cuda_graphs decision into ``record`` (a CompileRecord); ``backend``: the one that
    compiled, where it is not the recipe's (compile explain always compiles with accelrun)."""
    from accelrun.compile.cuda_graph_policy import CudaGraphMode, CudaGraphsReport, decide_for_run

    mode = CudaGraphMode(cfg.compile.cuda_graphs)
    record.cuda_graphs = CudaGraphsReport(mode, decide_for_run(
        mode, device_type=device_type, ranks=ranks, document_packing=cfg.data.packing == "document",
        backend=backend or cfg.compile.backend))

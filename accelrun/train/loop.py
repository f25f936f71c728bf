"""The training loop: data → forward/backward (accumulated) → clip → optimizer → LR → metrics → checkpoint.

Everything the loop needs is built beforehand (``accelrun.train.setup``); the loop only steps,
measures and saves. Each optimizer step is timed in parts (data, forward, backward, optimizer)
so the report can say where the time goes. Its results stay on the device until the host reads them
(``report.read_every``, ``step_reads``): metrics lines, the divergence check and the agreement to stop
on a signal happen at those reads; a step that evaluates, saves a checkpoint or ends the run is read
before the checkpoint is saved.
"""

from __future__ import annotations

import gc
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from accelrun.data.document_packing import DocumentBatch
from accelrun.data.loss_mask import count_loss_targets
from accelrun.dist import stop
from accelrun.errors import CollectiveTimeout, TrainingDiverged  # noqa: F401 (tests import it from here)
from accelrun.report.memory import peak_memory_bytes, peak_reserved_bytes, reset_peak_memory
from accelrun.report.metrics import MetricsWriter
from accelrun.report.profiler import profile_steps
from accelrun.train.checkpoint import save_checkpoint
from accelrun.train.evaluate import evaluate
from accelrun.train.grad_clip import clip_grad_norm_
from accelrun.train.host_malloc import step_end_release
from accelrun.train.lineage import prune_history_checkpoints
from accelrun.train.precision import autocast
from accelrun.train.progress import TrainProgress
from accelrun.train.router_metrics import router_step_totals
from accelrun.train.setup import TrainSetup
from accelrun.train.step_clock import StepClock
from accelrun.train.step_reads import PendingStep, PendingSteps, StepMarks, raise_if_diverged, read_interval
from accelrun.train.token_mean import micro_batch_weights, uses_token_mean


@dataclass
class LoopOutcome:
    status: str  # finished | preempted (SIGTERM) | interrupted (SIGINT) | stopped (stop_after_step)
    last_step: int
    checkpoints: list[Path] = field(default_factory=list)
    checkpoint_time_s: float = 0.0
    signum: int = 0  # the signal the ranks stopped on (dist.stop)
    # This rank's steps as summary.is_steady reads them (time, compiled, profiled): rank 0's report
    # shows every rank's median steady step time.
    step_times: list[dict] = field(default_factory=list)



def per_device(loss_targets: torch.Tensor, held: int, tokens_per_step: int) -> torch.Tensor:
    """The targets in the loss as a share of this device's tokens, as ``tokens_per_step`` counts them
    (the job's over the world): under tensor or pipeline parallelism every rank of a group holds the
    group's whole batch, and its 512 targets read as 200% of the 256 tokens each device computes (a new
    user's report). Stays on the device: read with the step's other figures."""
    return loss_targets if not held or held == tokens_per_step else loss_targets * tokens_per_step // held

def run_loop(
    s: TrainSetup,
    metrics: MetricsWriter | None,
    progress: TrainProgress | None,
    *,
    stop_after_step: int | None = None,
    trackers=None,
) -> LoopOutcome:
    """Train from ``s.start_step`` to ``train.steps``. ``stop_after_step`` simulates a preemption (tests)."""
    cfg, dev = s.config, s.device
    total = cfg.train.steps
    outcome = LoopOutcome("finished", s.start_step)
    last_ckpt: Path | None = s.resumed_from
    parts = s.pipeline.modules if s.pipeline is not None else [s.model]
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    clip = cfg.train.grad_clip if cfg.train.grad_clip else math.inf  # None or 0: measure, do not clip
    stage_group = s.pipeline.group if s.pipeline is not None else None
    for part in parts:
        part.train()
    run_dir = s.checkpoint_dir.parent
    where = {"step": s.start_step, "phase": "starting"}  # for a collective that times out
    read_every = read_interval(cfg, dev)  # report.read_every: CPU every step, GPU every log_every steps
    pending = PendingSteps(s.flops.value, s.peak.tflops)
    token_mean = uses_token_mean(cfg, s.pipeline is not None)  # chat, documents: mean over the step's targets
    release = step_end_release(cfg.train.cpu_malloc) if dev.type == "cpu" else None  # host_malloc: trims
    # What setup made (imports, the model, the optimizer) lives as long as the run: out of the garbage
    # collector's sight, its collections walk only what the steps allocate. A full one walked all of
    # it inside the first step: 0.28 s of a 0.3 s graph-cache load's aftermath (transformers' Llama).
    # Undone when the loop ends.
    gc.freeze()
    try:
        with (stop.catch_signals(),
              profile_steps(cfg.report.profile_steps, run_dir, s.start_step, s.ctx.rank) as prof):
            for step in range(s.start_step + 1, total + 1):
                lr = s.optimizer.param_groups[0]["lr"]
                clock = StepClock(dev)  # CUDA: events at the phase boundaries, read at the next host read
                m_start = clock.mark()
                reset_peak_memory(dev)  # CUDA: this step's peak, not setup's or an earlier step's
                comm_at_start = s.comm_timer.seconds if s.comm_timer is not None else 0.0
                compiles_at_start = _graphs_compiled(s)
                where.update(step=step, phase="forward and backward")
                spans = []  # per micro-batch: its (start, data loaded, forward done, backward done) marks
                loss_sum = torch.zeros((), device=dev)
                loss_targets = torch.zeros((), dtype=torch.int64, device=dev)  # targets in the loss (chat masks some)
                held = 0  # the targets of this rank's batches: its tensor- and pipeline-parallel peers hold them too
                step_batches, weights = None, None
                for i in range(s.grad_accum):
                    m0 = clock.mark()
                    if token_mean and i == 0:  # the step's batches first: each is weighted by its targets
                        step_batches = [next(s.data) for _ in range(s.grad_accum)]
                        weights = micro_batch_weights([b[1] for b in step_batches], s.ctx, dev)
                    batch = step_batches[i] if step_batches is not None else next(s.data)
                    inputs_BT, targets_BT = batch[0].to(dev, non_blocking=True), batch[1].to(dev, non_blocking=True)
                    # data.packing = document: each token's position in its document goes to the model too.
                    positions = ((batch.positions.to(dev, non_blocking=True),) if isinstance(batch, DocumentBatch)
                                 else ())
                    m1 = clock.mark()
                    counted = count_loss_targets(targets_BT)
                    loss_targets += counted
                    held += targets_BT.numel()
                    if s.pipeline is not None:
                        # The schedule interleaves micro-batches' forwards and backwards: timed as one.
                        with autocast(cfg.train.precision, dev):
                            loss = s.pipeline.step(inputs_BT, targets_BT, *positions)
                        m2 = m3 = clock.mark()
                    else:
                        with s.loss_context(), autocast(cfg.train.precision, dev):
                            loss = s.loss_fn(inputs_BT, targets_BT, *positions)
                            loss = loss * weights[i] if weights is not None else loss / s.grad_accum
                        # A micro-batch with every target masked (a window of a long user turn) is a mean over
                        # nothing, NaN: cross-entropy gives it zero gradients, and it adds 0 to the step's loss.
                        loss = torch.where(counted > 0, loss, torch.zeros_like(loss))
                        m2 = clock.mark()
                        with s.loss_context():  # loss parallel: backward through the sharded loss too
                            loss.backward()
                        m3 = clock.mark()
                    loss_sum += loss.detach()
                    spans.append((m0, m1, m2, m3))
                if s.expert_parallel is not None:  # experts' gradients: summed over their holders, averaged
                    s.expert_parallel.reduce_gradients()
                m4 = clock.mark()
                # The norm and the loss stay on the device until the next read (step_reads).
                where["phase"] = "the gradient norm"
                grad_norm_t = clip_grad_norm_(params, clip, stage_group)
                where["phase"] = "averaging the loss"
                loss_t = s.ctx.mean_over_dp(loss_sum)
                where["phase"] = "the optimizer step"
                s.optimizer.step()
                s.scheduler.step()
                s.optimizer.zero_grad(set_to_none=True)
                m5 = clock.mark()
                done = PendingStep(step, clock, StepMarks(m_start, spans, m4, m5), loss_t, grad_norm_t, None, lr=lr,
                                   tokens=s.tokens_per_step, loss_tokens=per_device(loss_targets, held, s.tokens_per_step),
                                   compile=step == s.start_step + 1 and s.compiles or _graphs_compiled(s) != compiles_at_start,
                                   mem_peak_bytes=peak_memory_bytes(dev), mem_reserved_bytes=peak_reserved_bytes(dev))
                where["phase"] = "summing the router's figures"
                done.router = router_step_totals(s.model, s.ctx.distributed)  # MoE: every rank, every step
                if s.expert_parallel is not None:
                    done.extras.update(s.expert_parallel.step_metrics())
                if s.comm_timer is not None:  # blocked in collectives during this step (inside the parts above)
                    done.extras["comm_s"] = s.comm_timer.seconds - comm_at_start
                if s.cp_stats is not None:  # context parallelism's key/value all-gathers (eager forward)
                    done.extras.update(s.cp_stats.step_metrics())
                if s.comm_trace is not None:  # FSDP's / compiled graphs' collectives: exposed, busy, overlap
                    done.extras.update(s.comm_trace.step_metrics())
                evaluating = s.eval_data is not None and (step % cfg.eval.every == 0 or step == total)
                if evaluating:
                    where["phase"] = "evaluating"
                    done.extras["val_loss"] = evaluate(s)  # every rank: its shard, averaged over data parallel
                if release is not None:
                    release()
                prof.step(step, done.extras)  # report.profile_steps: starts/stops the trace, marks profiled steps
                pending.add(done)
                scheduled_save = cfg.checkpoint.enabled and (
                    step % cfg.checkpoint.every == 0 or (step == total and cfg.checkpoint.save_final))
                # Read before a checkpoint too: a diverged step is found before one is saved after it. The
                # first step (the compiling one) is read at once: its loss and the first progress line
                # come right after it rather than read_every steps later.
                first = step == s.start_step + 1
                if not (step % read_every == 0 or step in (total, stop_after_step) or scheduled_save or evaluating
                        or first):
                    continue
                where["phase"] = "reading the steps' results"
                for record in pending.read():
                    raise_if_diverged(record, last_ckpt)  # the steps before it are written, none after
                    if metrics is not None:  # rank 0 only
                        metrics.write(record)
                        if trackers is not None:
                            trackers.log_step(record)
                        progress.update(record["step"], record["loss"], record["tokens_per_s"] or 0.0,
                                        record.get("val_loss"))
                    outcome.last_step = record["step"]
                    outcome.step_times.append({k: record.get(k) for k in ("step_time_s", "compile", "profiled")})

                # Ranks may see the signal at different steps (or not at all); they stop at the same read.
                where["phase"] = "agreeing whether to stop"
                preempted = s.ctx.any(stop.requested() != 0)
                if preempted:  # which signal: SIGTERM's 143 wins over SIGINT's 130
                    outcome.signum = signal.SIGTERM if s.ctx.any(stop.requested() == signal.SIGTERM) else signal.SIGINT
                stopping = preempted or step == stop_after_step
                if scheduled_save or (cfg.checkpoint.enabled and preempted):
                    where["phase"] = "saving a checkpoint"
                    t_ck = time.perf_counter()
                    last_ckpt = save_checkpoint(
                        s.checkpoint_dir, step, s.model, s.optimizer, s.train_state(), cfg.checkpoint.keep, s.ctx
                    )
                    outcome.checkpoints.append(last_ckpt)
                    if s.ctx.is_main and s.resumed_from is not None:  # checkpoint.keep counts the whole history
                        prune_history_checkpoints(s.checkpoint_dir.parent, cfg.checkpoint.keep)
                    outcome.checkpoint_time_s += time.perf_counter() - t_ck
                if stopping and step < total:  # a signal during the last step changes nothing
                    outcome.status = stop.STATUS[outcome.signum] if preempted else "stopped"
                    break
    except RuntimeError as e:
        # gloo says "timed out"; NCCL's watchdog (under TORCH_NCCL_BLOCKING_WAIT) "... before timing out".
        if s.ctx.distributed and any(w in str(e).lower() for w in ("timed out", "timing out")):
            raise CollectiveTimeout(s.ctx.rank, where["step"], where["phase"], cfg.parallel.timeout_s, e) from None
        raise
    finally:
        gc.unfreeze()  # collected as usual again once the loop is over (a process may train again)
    return outcome


def _graphs_compiled(s: TrainSetup) -> int:
    """Graphs compiled in this process so far (Dynamo's count, and the accelrun backends' own, which the
    graph cache's precompiles add to). A step that changes it compiled: a recompile (an integer attribute
    the forward changes, a new size) is left out of the steady-state figures like the first step, where
    its seconds counted as a step's (a counter in a user's forward: 16 compiles, a 0.4 s median step)."""
    if not s.compiles:
        return 0  # an eager run compiles nothing
    from accelrun.torch_private import dynamo_counters

    return dynamo_counters["stats"]["unique_graphs"] + sum(record.dynamo_graphs for _, record in s.compile_parts)

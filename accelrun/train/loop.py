"""The training loop: data → forward/backward (accumulated) → clip → optimizer → LR → metrics → checkpoint.

Everything the loop needs is built beforehand (``accelrun.train.setup``); the loop only steps,
measures and saves. Each optimizer step is timed in parts (data, forward, backward, optimizer)
so the report can say where the time goes.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from accelrun.dist import stop
from accelrun.errors import CollectiveTimeout, TrainingDiverged
from accelrun.report.memory import peak_memory_bytes, peak_reserved_bytes, reset_peak_memory
from accelrun.report.metrics import MetricsWriter, StepMetrics
from accelrun.report.profiler import profile_steps
from accelrun.train.checkpoint import save_checkpoint
from accelrun.train.evaluate import evaluate
from accelrun.train.grad_clip import clip_grad_norm_
from accelrun.train.lineage import prune_history_checkpoints
from accelrun.train.precision import autocast
from accelrun.train.progress import TrainProgress
from accelrun.train.router_metrics import router_step_metrics
from accelrun.train.setup import TrainSetup
from accelrun.train.step_clock import StepClock


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
    try:
        with (stop.catch_signals(),
              profile_steps(cfg.report.profile_steps, run_dir, s.start_step, s.ctx.rank) as prof):
            for step in range(s.start_step + 1, total + 1):
                lr = s.optimizer.param_groups[0]["lr"]
                t_step = time.perf_counter()
                reset_peak_memory(dev)  # CUDA: this step's peak, not setup's or an earlier step's
                comm_at_start = s.comm_timer.seconds if s.comm_timer is not None else 0.0
                where.update(step=step, phase="forward and backward")
                clock = StepClock(dev)  # CUDA: events at the phase boundaries, one synchronisation per step
                spans = []  # per micro-batch: its (start, data loaded, forward done, backward done) marks
                loss_sum = torch.zeros((), device=dev)
                for _ in range(s.grad_accum):
                    m0 = clock.mark()
                    inputs_BT, targets_BT = next(s.data)
                    inputs_BT, targets_BT = inputs_BT.to(dev, non_blocking=True), targets_BT.to(dev, non_blocking=True)
                    m1 = clock.mark()
                    if s.pipeline is not None:
                        # The schedule interleaves micro-batches' forwards and backwards: timed as one.
                        with autocast(cfg.train.precision, dev):
                            loss = s.pipeline.step(inputs_BT, targets_BT)
                        m2 = m3 = clock.mark()
                    else:
                        with s.loss_context(), autocast(cfg.train.precision, dev):
                            loss = s.loss_fn(inputs_BT, targets_BT) / s.grad_accum
                        m2 = clock.mark()
                        with s.loss_context():  # loss parallel: backward through the sharded loss too
                            loss.backward()
                        m3 = clock.mark()
                    loss_sum += loss.detach()
                    spans.append((m0, m1, m2, m3))
                if s.expert_parallel is not None:  # experts' gradients: summed over their holders, averaged
                    s.expert_parallel.reduce_gradients()
                m4 = clock.mark()
                # The norm and the loss stay on the device until the step's one synchronisation.
                where["phase"] = "the gradient norm"
                grad_norm_t = clip_grad_norm_(params, clip, stage_group)
                where["phase"] = "averaging the loss"
                loss_t = s.ctx.mean_over_dp(loss_sum)
                where["phase"] = "the optimizer step"
                s.optimizer.step()
                s.scheduler.step()
                s.optimizer.zero_grad(set_to_none=True)
                m5 = clock.mark()
                clock.finish()
                t_end = time.perf_counter()
                loss_value, grad_norm = float(loss_t), float(grad_norm_t)
                # Read after the optimizer step: no checkpoint follows a diverged step, so the last one
                # saved is still the last good one.
                for what, value in (("the loss", loss_value), ("the gradient norm", grad_norm)):
                    if not math.isfinite(value):
                        raise TrainingDiverged(step, what, value, last_ckpt)
                data_s = sum(clock.seconds(a, b) for a, b, _, _ in spans)
                fwd_s = sum(clock.seconds(b, c) for _, b, c, _ in spans)
                bwd_s = sum(clock.seconds(c, d) for _, _, c, d in spans)
                record = StepMetrics(
                    step=step, loss=loss_value, lr=lr, grad_norm=grad_norm, step_time_s=t_end - t_step,
                    data_time_s=data_s, tokens=s.tokens_per_step, mem_peak_bytes=peak_memory_bytes(dev),
                    compile=step == s.start_step + 1 and s.compiles,
                ).to_dict(flops_per_token=s.flops_per_token, peak_tflops=s.peak.tflops)
                record.update(forward_s=fwd_s, backward_s=bwd_s, optimizer_s=clock.seconds(m4, m5))
                if (reserved := peak_reserved_bytes(dev)) is not None:  # what the allocator held (CUDA)
                    record["mem_reserved_bytes"] = reserved
                record.update(router_step_metrics(s.model, s.ctx.distributed))  # MoE: load, drops, aux loss
                if s.expert_parallel is not None:
                    record.update(s.expert_parallel.step_metrics())
                if s.comm_timer is not None:  # blocked in collectives during this step (inside the parts above)
                    record["comm_s"] = s.comm_timer.seconds - comm_at_start
                if s.cp_stats is not None:  # context parallelism's key/value all-gathers (eager forward)
                    record.update(s.cp_stats.step_metrics())
                if s.comm_trace is not None:  # FSDP's / compiled graphs' collectives: exposed, busy, overlap
                    record.update(s.comm_trace.step_metrics())
                if s.eval_data is not None and (step % cfg.eval.every == 0 or step == total):
                    where["phase"] = "evaluating"
                    record["val_loss"] = evaluate(s)  # every rank: its shard, averaged over data parallel
                prof.step(step, record)  # report.profile_steps: starts/stops the trace, marks profiled steps
                if metrics is not None:  # rank 0 only
                    metrics.write(record)
                    if trackers is not None:
                        trackers.log_step(record)
                    progress.update(step, loss_value, record["tokens_per_s"] or 0.0)
                outcome.last_step = step
                outcome.step_times.append({k: record.get(k) for k in ("step_time_s", "compile", "profiled")})

                # Ranks may see the signal at different steps (or not at all); they stop at the same one.
                where["phase"] = "agreeing whether to stop"
                preempted = s.ctx.any(stop.requested() != 0)
                if preempted:  # which signal: SIGTERM's 143 wins over SIGINT's 130
                    outcome.signum = signal.SIGTERM if s.ctx.any(stop.requested() == signal.SIGTERM) else signal.SIGINT
                stopping = preempted or step == stop_after_step
                due = cfg.checkpoint.enabled and (
                    step % cfg.checkpoint.every == 0 or (step == total and cfg.checkpoint.save_final) or preempted
                )
                if due:
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
    return outcome

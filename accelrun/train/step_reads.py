"""Finished training steps whose results are still on the device, read on the host every few steps.

On a CPU a step's work is done when its calls return, so reading its loss costs nothing. On CUDA a
host read (``float(loss)``, ``.item()``, ``.tolist()``) waits for the device to finish everything
queued so far: reading after every step keeps the host from queueing step n+1 while the GPU still runs
step n. So the loop keeps each finished step here, its loss, gradient norm and router totals as device
tensors and its phase boundaries as :class:`StepClock` marks, with what the host already knows (the
learning rate, the allocator's memory counters, communication counters), and reads them all at once
every ``report.read_every`` steps: one synchronisation, one transfer, records in step order.

    pending = PendingSteps(flops_per_token, peak_tflops)
    pending.add(PendingStep(step, clock, marks, loss_t, grad_norm_t, None, lr=..., tokens=..., ...))
    for record in pending.read():   # the metrics.jsonl lines of every step added since the last read
        raise_if_diverged(record, last_checkpoint)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from accelrun.errors import TrainingDiverged
from accelrun.report.metrics import StepMetrics
from accelrun.train.router_metrics import router_metrics_from_totals
from accelrun.train.step_clock import StepClock


def read_interval(cfg, device: torch.device) -> int:
    """Steps between host reads: ``report.read_every``, or by default every step on a CPU (reading
    is free there) and every ``report.log_every`` steps on an accelerator."""
    if cfg.report.read_every is not None:
        return cfg.report.read_every
    return 1 if torch.device(device).type == "cpu" else cfg.report.log_every


@dataclass(frozen=True)
class StepMarks:
    """A step's phase boundaries, as indices of its clock's marks."""

    start: int  # before the peak-memory reset and the first batch
    spans: list[tuple[int, int, int, int]]  # per micro-batch: start, data loaded, forward done, backward done
    grads_done: int  # gradients complete (expert-parallel reduction included): the optimizer phase starts
    end: int  # after the optimizer step and zero_grad


@dataclass
class PendingStep:
    step: int
    clock: StepClock
    marks: StepMarks
    loss: torch.Tensor  # 0-dim, averaged over data parallel
    grad_norm: torch.Tensor  # 0-dim, before clipping
    router: torch.Tensor | None  # router_step_totals(...): the MoE router's packed totals
    lr: float
    tokens: int
    compile: bool
    mem_peak_bytes: int | None  # read at the step's end: the allocator's counters are host-side
    mem_reserved_bytes: int | None
    # 0-dim int: this rank's targets in the loss (tokens less the masked ones); None: every token
    loss_tokens: torch.Tensor | None = None
    # Host-known figures written after the router's, in this order: expert-parallel exchanges,
    # communication, context parallelism, the comm trace, val_loss, the profiler's flag.
    extras: dict[str, Any] = field(default_factory=dict)


class PendingSteps:
    """Steps finished but not yet read on the host, oldest first."""

    def __init__(self, flops_per_token: float | None, peak_tflops: float | None) -> None:
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self._steps: list[PendingStep] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, pending: PendingStep) -> None:
        self._steps.append(pending)

    def read(self) -> list[dict]:
        """The metrics.jsonl records of every pending step, in step order, after one synchronisation."""
        steps, self._steps = self._steps, []
        if not steps:
            return []
        steps[-1].clock.finish()  # the one synchronisation: the newest step's events are the last queued
        for older in steps[:-1]:
            older.clock.finish(synchronize=False)
        return [self._record(p, values) for p, values in zip(steps, _host_values(steps), strict=True)]

    def _record(self, p: PendingStep, values: list[float]) -> dict:
        clock, m = p.clock, p.marks
        record = StepMetrics(
            step=p.step, loss=values[0], lr=p.lr, grad_norm=values[1], step_time_s=clock.seconds(m.start, m.end),
            data_time_s=sum(clock.seconds(a, b) for a, b, _, _ in m.spans), tokens=p.tokens,
            mem_peak_bytes=p.mem_peak_bytes, compile=p.compile,
        ).to_dict(flops_per_token=self.flops_per_token, peak_tflops=self.peak_tflops)
        record.update(forward_s=sum(clock.seconds(b, c) for _, b, c, _ in m.spans),
                      backward_s=sum(clock.seconds(c, d) for _, _, c, d in m.spans),
                      optimizer_s=clock.seconds(m.grads_done, m.end))
        # tokens (and tokens_per_s) count what was computed; loss_tokens what the loss counted (chat data
        # with data.loss_on: assistant leaves the rest out).
        record["loss_tokens"] = int(values[2])
        if p.mem_reserved_bytes is not None:  # what the allocator held (CUDA)
            record["mem_reserved_bytes"] = p.mem_reserved_bytes
        if p.router is not None:  # MoE: load, drops, aux loss
            record.update(router_metrics_from_totals(values[3:]))
        record.update(p.extras)
        return record


def _host_values(steps: list[PendingStep]) -> list[list[float]]:
    """Each step's [loss, grad norm, loss tokens, *router totals] as Python floats, in one device-to-host copy."""
    home = steps[-1].loss.device
    parts = []
    for p in steps:
        loss_tokens = p.loss_tokens if p.loss_tokens is not None else torch.tensor(p.tokens)
        parts += [p.loss.detach().reshape(1), p.grad_norm.detach().reshape(1), loss_tokens.reshape(1)]
        if p.router is not None:
            parts.append(p.router.reshape(-1))
    # float64 holds every float32/bf16 value exactly: the figures equal float(tensor) of each.
    flat = torch.cat([t.to(home, torch.float64) for t in parts]).tolist()
    out, at = [], 0
    for p in steps:
        n = 3 + (p.router.numel() if p.router is not None else 0)
        out.append(flat[at:at + n])
        at += n
    return out


def raise_if_diverged(record: dict, last_checkpoint: Path | None) -> None:
    """TrainingDiverged naming the step if its loss or gradient norm is not finite."""
    for what, key in (("the loss", "loss"), ("the gradient norm", "grad_norm")):
        if not math.isfinite(record[key]):
            raise TrainingDiverged(record["step"], what, record[key], last_checkpoint)

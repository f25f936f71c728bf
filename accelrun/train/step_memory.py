"""What one training step of a recipe adds to memory on this CPU, measured, beside what the planner predicts.

Measured: the CPU allocator's peak during one forward and backward (``accelrun.report.allocator_peak``)
above what was alive as it began: parameters, gradients (kept from the warm-up steps, so backward
accumulates into them) and the optimizer's state are already there, so what is left is the step's own
memory: activations, what backward rebuilds, gradients of activations, logits. Predicted: the plan's
live terms less those same three static ones.

One process, the recipe's model built whole, its checkpointing and compile settings applied as
training applies them (``apply_activation_checkpointing`` then ``compile_model``).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from accelrun.compile.compile_model import checkpointed_blocks, compile_model
from accelrun.config.preflight import ids_the_logits_cover
from accelrun.config.schema import RunConfig
from accelrun.dist.activation_checkpoint import apply_activation_checkpointing
from accelrun.models import build_model, transformer_blocks
from accelrun.models.build import data_vocab, training_loss_fn
from accelrun.report.allocator_peak import allocator_peak

# The plan's terms that live all step (accelrun.plan.memory): the measurement's baseline holds them.
STATIC_TERMS = ("parameters (fp32)", "gradients (fp32)", "optimizer state (AdamW m, v)")


@dataclass(frozen=True)
class StepMemory:
    measured_bytes: int  # the allocator's peak during forward + backward, above its start
    step_s: list[float]  # forward + backward + optimizer step, each timed step after the warm-up
    loss: float


def measure_step(cfg: RunConfig, timed_steps: int = 0, warmup_steps: int = 2) -> StepMemory:
    """Warm up (compiling), measure one step's memory under the profiler, then time ``timed_steps`` more."""
    t = cfg.train
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, torch.device("cpu"), seed=t.seed)
    blocks = transformer_blocks(model)
    if t.activation_checkpoint.mode != "none" and (found := checkpointed_blocks(model, blocks)) is not None:
        apply_activation_checkpointing(found, t.activation_checkpoint)  # the blocks training wraps (dist/layout)
    compile_model(model, blocks, cfg.compile, precision=t.precision)
    vocab_size, _ = data_vocab(cfg.model, model)  # a user's model: its token table's rows
    loss_fn = training_loss_fn(model, ids_the_logits_cover(cfg, vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    g = torch.Generator().manual_seed(t.seed)
    tokens, targets = (torch.randint(0, vocab_size, (t.micro_batch, t.seq_len), generator=g) for _ in range(2))

    def step() -> float:
        loss = loss_fn(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline
        return float(loss.detach())

    for _ in range(warmup_steps):
        step()
    gc.collect()
    with allocator_peak() as peak:
        loss = loss_fn(tokens, targets)
        loss.backward()
    value = float(loss.detach())
    del loss
    optimizer.zero_grad(set_to_none=False)
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if peak.events == 0:
        raise RuntimeError("the profiler reported no CPU allocations: nothing was measured")
    return StepMemory(peak.bytes, times, value)


def predicted_step_bytes(plan) -> float:
    """The plan's live bytes at its peak less the static terms (what ``measure_step`` measures)."""
    return sum(term.bytes for term in plan.memory.terms
               if term.name not in STATIC_TERMS and not term.name.startswith(("allocator", "runtime")))

"""Pipeline parallelism with ``torch.distributed.pipelining``: a built-in model cut into stages by
layers (``parallel.pp_layers``, or balanced with the ends counted: ``accelrun.plan.stage_split``), a schedule from the recipe, micro-batches from
``parallel.microbatches``. What is cut is the family's to say (``ModelSpec``): the blocks
(``blocks_attr``) and the ends only the first and last stages keep (``first_stage_ends``,
``last_stage_ends``).

Stages keep the whole model's parameter names (their blocks sit in a ModuleDict keyed by layer
index), so a pipelined run's checkpoints load into any other layout and back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from accelrun.config.schema import INTERLEAVED_SCHEDULES
from accelrun.dist.collective import to_collective_device
from accelrun.dist.tp import loss_context
from accelrun.models.families import ModelSpec, get_family
from accelrun.plan.stage_split import EndCosts, layer_ranges, split_layers
from accelrun.torch_private import functorch_config

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
# Schedules that run a stage's backward in two halves, input gradients then weight gradients, keeping its
# autograd graph between them (retain_graph=True).
SPLIT_BACKWARD = {"zero_bubble"}


def microbatch_loss(grad_accum: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last stage's loss of one micro-batch: its mean, over the accumulation steps (gradient
    accumulation sums; the pipeline divides by its micro-batches too, see ``Pipeline._loss``)."""

    def loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten()) / grad_accum

    return loss


def stage_layers(n_layers: int, n_stages: int, explicit: list[list[int]] | None = None,
                 ends: EndCosts = EndCosts()) -> list[range]:
    """Each stage's layers: ``explicit`` (``parallel.pp_layers``, validated with the recipe: every
    layer once, in order, one list per stage) or the planner's split (``accelrun.plan.stage_split``):
    balanced, the first stage's embedding and the last stage's head counted as ``ends``."""
    if explicit is None:
        return layer_ranges(split_layers(n_layers, n_stages, ends))
    if len(explicit) != n_stages or sum(map(len, explicit)) != n_layers:
        raise ValueError(f"pp_layers {explicit} does not split {n_layers} layers into {n_stages} stages")
    return [range(stage[0], stage[-1] + 1) for stage in explicit]


def family_of(model: nn.Module) -> ModelSpec:
    """The spec of a built-in model (its ``args.arch`` names the family)."""
    return get_family(model.args.arch)


def stage_module(model: nn.Module, stage: int, n_stages: int, layers: range,
                 spec: ModelSpec | None = None) -> nn.Module:
    """A module of ``model``'s class holding only what stage ``stage`` runs: ``model``'s own submodules
    (not copies: the model is built on the meta device and each stage is materialised after its
    layout is applied, so nothing of the whole model is ever allocated or copied). ``spec``: the
    model's family (default: from ``model.args.arch``)."""
    spec = spec or family_of(model)
    blocks = getattr(model, spec.blocks_attr)
    part = copy.copy(model)  # the class and plain attributes (args); then a module state of its own
    nn.Module.__init__(part)
    part.train(model.training)
    for name, child in model.named_children():
        if name == spec.blocks_attr:
            child = nn.ModuleDict({str(i): blocks[i] for i in layers})
        elif (name in spec.first_stage_ends and stage != 0) or (name in spec.last_stage_ends
                                                                and stage != n_stages - 1):
            child = None
        part.add_module(name, child)
    for name, p in model.named_parameters(recurse=False):
        part.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        part.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
    return part


def receive_sequence_shards(part: nn.Module, spec: ModelSpec, tp: int) -> None:
    """Sequence parallelism leaves the residual stream split along the sequence, (B, T / tp, D) per TP
    rank, and that is what one stage sends the next: a stage without the first stage's ends (it starts
    from hidden states, not tokens) is told so, since its blocks gather the whole sequence and its
    rotary tables must cover all of it."""
    if any(getattr(part, end, None) is None for end in spec.first_stage_ends):
        part.stream_shards = tp


@dataclass
class PipelineTrace:
    """What this rank's stages did in their first step, for the report (and tests): the shape of the
    hidden states each stage sent on, and how the last stage's logits reached the loss."""

    sent: dict[int, list[int]] = field(default_factory=dict)  # stage -> the (micro-batch, tokens, dim) it sent
    logits: str | None = None  # "vocabulary-sharded over N ranks" or "whole"

    def as_dict(self, stages: list[int], layers: dict[int, range] | None = None) -> dict:
        out = {"stages": stages, "sent": {str(k): v for k, v in sorted(self.sent.items())}, "logits": self.logits}
        if layers is not None:  # each stage's first and last layer
            out["layers"] = {str(k): [r[0], r[-1]] for k, r in sorted(layers.items())}
        return out


def _layout_of(logits: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(logits, DTensor) and any(isinstance(p, Shard) for p in logits.placements):
        return f"vocabulary-sharded over {logits.device_mesh.size()} ranks"
    return "whole"


class Pipeline:
    """This rank's stages and the schedule that drives them; ``step`` runs one batch through.

    ``vocab_parallel``: the last stage's logits are vocabulary-sharded DTensors (``parallel.loss_parallel``);
    the schedule's forward and backward then run in ``loss_parallel()``, which the sharded loss needs.
    ``ends``: what the first and last stage run besides their blocks, in blocks, for the split made
    without ``layers`` (``accelrun.plan.stage_split.recipe_end_costs``)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, schedule: str, microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                 layers: list[list[int]] | None = None, spec: ModelSpec | None = None,
                 vocab_parallel: bool = False, stages_per_rank: int = 1, ends: EndCosts = EndCosts()):
        self.spec = spec = spec or family_of(model)
        pp_mesh = mesh["pp"]
        self.group = pp_mesh.get_group()
        pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
        # Several ("virtual") stages per rank for the interleaved schedules, looped: rank r holds r, r + pp, ...
        n_stages = pp_size * stages_per_rank
        ranges = stage_layers(len(getattr(model, spec.blocks_attr)), n_stages, layers, ends)
        self.stage_layers = ranges
        self.stage_ids = list(range(pp_rank, n_stages, pp_size))
        self.modules = [stage_module(model, s, n_stages, ranges[s], spec) for s in self.stage_ids]
        self.has_first, self.has_last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        self.n_stages, self.schedule_name, self.microbatches = n_stages, schedule, microbatches
        self._loss_fn, self._device, self.vocab_parallel = loss_fn, device, vocab_parallel
        self.trace = PipelineTrace()
        for s, m in zip(self.stage_ids, self.modules, strict=True):
            if s != n_stages - 1:
                m.register_forward_hook(self._record_sent(s))
        self.schedule = None  # built after the modules are sharded (FSDP, TP): stages capture them

    def _record_sent(self, stage: int):
        def hook(module, args, out):
            self.trace.sent.setdefault(stage, list(out.shape))

        return hook

    def _loss(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        if self.trace.logits is None:
            self.trace.logits = _layout_of(logits_BTV)
        # Each micro-batch's share of the step: the schedule sums their gradients (scale_grads=False).
        # torch's scale_grads divides the stage's whole .grad at every schedule step, so with gradient
        # accumulation the earlier steps' parts were divided again and again (a trial's step-1 gradient
        # norm 3.19 against one rank's 6.87 at 4 accumulation steps).
        return self._loss_fn(logits_BTV, targets_BT) / self.microbatches

    def build_schedule(self) -> None:
        stages = [PipelineStage(m, s, self.n_stages, self._device, group=self.group)
                  for m, s in zip(self.modules, self.stage_ids, strict=True)]
        cls = SCHEDULES[self.schedule_name]
        arg = stages if self.schedule_name in INTERLEAVED_SCHEDULES else stages[0]
        self.schedule = cls(arg, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)

    def step(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor,
             positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one batch; returns the batch's mean loss on every pp rank.
        ``positions_BT`` (document packing) goes to every stage: each stage's blocks attend by document."""
        losses: list[torch.Tensor] = []
        args = (inputs_BT,) if self.has_first else ()
        kwargs: dict = {"target": targets_BT, "losses": losses} if self.has_last else {}
        if positions_BT is not None:  # model keyword arguments reach every stage, split like the inputs
            kwargs["positions_BT"] = positions_BT
        # A compiled stage's backward reuses its saved tensors' memory ("donated buffers"), which only a
        # backward that frees its graph may: a split backward's first half refused ("requires
        # retain_graph=False"). Off while the stages compile here (at the first step), for this schedule.
        split = functorch_config.patch(donated_buffer=False) if self.schedule_name in SPLIT_BACKWARD else nullcontext()
        with loss_context(self.vocab_parallel), split:  # the sharded loss's backward runs inside step() too
            self.schedule.step(*args, **kwargs)
        losses = [_local(x) for x in losses]  # a vocabulary-parallel loss is a replicated DTensor
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self._device)
        loss = to_collective_device(loss, self.group)
        dist.all_reduce(loss, group=self.group)  # only the last stage's rank holds it
        return loss.to(self._device)

    def trace_dict(self) -> dict:
        """The report's record of this rank: its stages, the layers each runs, what they sent, the logits."""
        return self.trace.as_dict(self.stage_ids, {s: self.stage_layers[s] for s in self.stage_ids})

    def blocks(self) -> list[nn.Module]:
        return [b for m in self.modules for b in getattr(m, self.spec.blocks_attr).values()]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def union_of(parts: list[nn.Module], spec: ModelSpec | None = None) -> nn.Module:
    """One module holding every parameter of this rank's stages under the whole model's names
    (``layers.<i>``, and the ends where this rank has them): what checkpoints and the optimizer see."""
    spec = spec or family_of(parts[0])
    union = nn.Module()
    blocks = {k: v for part in parts for k, v in getattr(part, spec.blocks_attr).items()}
    union.add_module(spec.blocks_attr, nn.ModuleDict(blocks))
    for end in spec.ends:
        held = [getattr(p, end) for p in parts if getattr(p, end) is not None]
        if held:
            setattr(union, end, held[0])
    return union

"""Compiled (graph-level) FSDP: ``parallel.fsdp_impl: compiled``.

Parameters are stored sharded, as FSDP2 stores them: each one a DTensor ``Shard(0)`` over the
data-parallel mesh (same names, shapes and placements, so checkpoints, gradient clipping and the
optimizer see what they see under ``fsdp2``). What differs is where the collectives happen. FSDP2
gathers and reduces in hooks, outside any graph. Here the model (or pipeline stage) is compiled
as one graph whose *units* (each transformer block, and each of the model's ends: embedding, final
norm, output layer) all-gather their parameters at the point they are called, through functional
collectives, and whose backward reduce-scatters the gradients::

    forward graph:  all_gather_into_tensor(shard) → wait_tensor → block compute → ...
    backward graph: ... → grad → reduce_scatter_tensor → wait_tensor → output

so the compiler's communication passes (``bucket_collectives``, ``schedule_overlap``) can merge
them, issue them early and wait late.

How: the model's ``forward`` becomes an eager wrapper that takes each shard's local tensor
(``DTensor.to_local``: the gradient flows back as a ``Shard(0)`` DTensor) and calls one compiled
function. That function runs a *shadow* of the model (a copy with meta stand-ins for parameters,
swapped for the local shards by ``torch.func.functional_call``) in which every unit's forward
gathers its own parameters and runs a *template* of the unit on the gathered tensors.

With tensor parallelism the sharding applies to each parameter's TP-local tensor: stored as a DTensor
over (dp_shard, tp) (FSDP2's placements for FSDP × TP), gathered over dp in the graph and rewrapped
as the TP DTensor the block's TP plan expects, so DTensor's TP collectives are graph nodes too.

Gradients are averaged over the data-parallel ranks (divided by the dp size before the
reduce-scatter, as FSDP2 does on gloo), so training matches ``fsdp2`` up to summation order.
The gathered parameters are saved for the backward (the graph does not gather them twice), so the
memory is that of ``reshard_after_forward: false``.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from accelrun.compile.compile_model import Compiled
from accelrun.compile.trace_settings import capturing_data_sized_outputs
from accelrun.config.errors import ConfigError

c10d_ops = torch.ops._c10d_functional


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split: dim-0 chunks of ``rows`` rows (``torch.chunk``'s sizes)."""

    shape: tuple[int, ...]
    rows: int  # rows per rank after padding (the last ranks may hold fewer, or none)
    group_size: int
    group_name: str

    def local_rows(self, rank: int) -> int:
        return max(0, min(self.rows, self.shape[0] - rank * self.rows))


class _GatherShard(torch.autograd.Function):
    """All-gather a dim-0 shard (padded to ``rows``); backward: reduce-scatter of the gradient,
    averaged over the group."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        ctx.spec, ctx.local_rows = spec, local.shape[0]
        pad = spec.rows - local.shape[0]
        if pad:
            local = torch.cat([local, local.new_zeros((pad, *local.shape[1:]))])
        gathered = c10d_ops.all_gather_into_tensor(local.contiguous(), spec.group_size, spec.group_name)
        gathered = c10d_ops.wait_tensor(gathered)
        return gathered[: spec.shape[0]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        pad = spec.rows * spec.group_size - grad.shape[0]
        if pad:
            grad = torch.cat([grad, grad.new_zeros((pad, *grad.shape[1:]))])
        # Divide before the sum (FSDP2's pre-division on backends without an average reduction).
        grad = (grad / spec.group_size).contiguous()
        shard = c10d_ops.reduce_scatter_tensor(grad, "sum", spec.group_size, spec.group_name)
        shard = c10d_ops.wait_tensor(shard)
        return shard[: ctx.local_rows], None


@dataclass(frozen=True)
class TPLayout:
    """A tensor-parallel parameter: the gathered (TP-local) tensor is rewrapped as this DTensor."""

    mesh: DeviceMesh
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _unit_forward(unit: nn.Module, template: nn.Module, names: list[str], specs: dict[str, ShardSpec],
                  tp: dict[str, TPLayout], *args, **kwargs):  # fmt: skip
    # Inside the compiled function the unit's parameters are the local shards (functional_call).
    full = {n: _GatherShard.apply(unit.get_parameter(n), specs[n]) for n in names}
    for n, t in tp.items():  # the module's TP plan expects its DTensor parameters
        full[n] = DTensor.from_local(full[n], t.mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride)
    return torch.func.functional_call(template, full, args, kwargs)


def _storage_placements(tp_placements: tuple, tp_size: int) -> tuple:
    """Placements over (dp_shard, tp) of a parameter sharded by TP, then its TP-local rows over dp."""
    from torch.distributed.tensor.placement_types import _StridedShard

    (tp_placement,) = tp_placements
    if isinstance(tp_placement, Shard) and tp_placement.dim == 0:
        # Rows split by TP first, then each TP block's rows by dp (FSDP2's layout for FSDP × TP).
        return (_StridedShard(0, split_factor=tp_size), tp_placement)
    return (Shard(0), tp_placement)


@dataclass
class CompiledFSDP:
    """What ``apply_compiled_fsdp`` did to one model or stage."""

    units: list[str]
    params: int
    specs: dict[str, ShardSpec] = field(default_factory=dict)


def _units(model: nn.Module, blocks: list[nn.Module] | None) -> list[tuple[str, nn.Module]]:
    """Blocks, then every other child holding parameters (the ends). The root may hold none itself."""
    names = {id(m): n for n, m in model.named_modules()}
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        raise ConfigError(f"parallel.fsdp_impl = compiled: {type(model).__name__} holds parameters of its own "
                          f"({', '.join(own)}); each must belong to a block or a child module")  # fmt: skip
    units = [(names[id(b)], b) for b in blocks or []]
    in_blocks = {id(p) for _, b in units for p in b.parameters()}
    for name, child in model.named_children():
        if any(id(p) not in in_blocks for p in child.parameters()):
            if any(id(p) in in_blocks for p in child.parameters()):
                raise ConfigError(f"parallel.fsdp_impl = compiled: {name} mixes block parameters with others")
            units.append((name, child))
    return units


def apply_compiled_fsdp(model: nn.Module, blocks: list[nn.Module] | None, mesh: DeviceMesh, backend: object,
                        fullgraph: bool = False) -> CompiledFSDP:  # fmt: skip
    """Shard ``model``'s parameters over ``mesh["dp_shard"]`` and compile its forward with ``backend``
    (a torch.compile backend) so that gathers and reduce-scatters are graph nodes."""
    if mesh["dp_replicate"].size() > 1:
        raise ConfigError("parallel.fsdp_impl = compiled supports parallel.dp_replicate = 1 only (use fsdp2 for HSDP)")
    dp_mesh = mesh["dp_shard"]
    group = dp_mesh.get_group()
    group_name, dp, rank = group.group_name, dp_mesh.size(), dp_mesh.get_local_rank()
    if len({id(p) for p in model.parameters()}) != len(list(model.named_parameters(remove_duplicate=False))):
        raise ConfigError("parallel.fsdp_impl = compiled does not support shared (tied) parameters; "
                          "set model.tie_embeddings = false")  # fmt: skip
    tp_size = mesh["tp"].size()
    storage_mesh = mesh["dp_shard", "tp"] if tp_size > 1 else dp_mesh
    units = _units(model, blocks)

    # The shadow and the templates: copies whose parameters are meta stand-ins (structure, forward
    # code and TP hooks; no storage).
    shadow = copy.deepcopy(model)
    specs: dict[str, ShardSpec] = {}
    for unit_name, unit in units:
        prefix = f"{unit_name}." if unit_name else ""
        shadow_unit = shadow.get_submodule(unit_name)
        template = copy.deepcopy(shadow_unit)
        names = [n for n, _ in unit.named_parameters()]
        unit_specs, unit_tp = {}, {}
        for n, p in unit.named_parameters():
            is_tp = isinstance(p, DTensor)
            full = p.to_local().detach() if is_tp else p.detach()
            rows = -(-full.shape[0] // dp) if full.ndim else 1
            spec = ShardSpec(tuple(full.shape), rows, dp, group_name)
            local = full[rank * rows: rank * rows + spec.local_rows(rank)].clone()
            if is_tp:
                unit_tp[n] = TPLayout(p.device_mesh, tuple(p.placements), tuple(p.shape), tuple(p.stride()))
                placements = _storage_placements(tuple(p.placements), tp_size)
            else:
                placements = (Shard(0), Replicate()) if tp_size > 1 else (Shard(0),)
            sharded = DTensor.from_local(local, storage_mesh, placements, run_check=False,
                                         shape=p.shape, stride=p.stride())  # fmt: skip
            owner_name, _, leaf = n.rpartition(".")
            unit.get_submodule(owner_name)._parameters[leaf] = nn.Parameter(sharded, requires_grad=p.requires_grad)
            # Meta stand-ins: the shard's shape in the shadow, the gathered one in the template.
            shadow_unit.get_submodule(owner_name)._parameters[leaf] = nn.Parameter(
                torch.empty_like(local, device="meta"))
            template.get_submodule(owner_name)._parameters[leaf] = nn.Parameter(torch.empty_like(full, device="meta"))
            unit_specs[n] = specs[prefix + n] = spec
        shadow_unit.forward = functools.partial(_unit_forward, shadow_unit, template, names, unit_specs, unit_tp)
        # The template runs the unit's hooks (TP's input and output layouts); the shadow must not again.
        for hooks in (shadow_unit._forward_pre_hooks, shadow_unit._forward_hooks):
            hooks.clear()

    original_forward = model.forward
    compiled = capturing_data_sized_outputs(
        torch.compile(functools.partial(_run_shadow, shadow), backend=backend, fullgraph=fullgraph), backend,
        fullgraph)

    @functools.wraps(original_forward)
    def forward(*args, **kwargs):
        shards = {n: p.to_local() for n, p in model.named_parameters()}
        buffers = dict(model.named_buffers())
        return compiled({**shards, **buffers}, *args, **kwargs)

    model.forward = forward
    return CompiledFSDP([u for u, _ in units], len(specs), specs)


def _run_shadow(shadow: nn.Module, tensors: dict[str, torch.Tensor], *args, **kwargs):
    return torch.func.functional_call(shadow, tensors, args, kwargs)


def compile_sharded(model: nn.Module, blocks: list[nn.Module] | None, mesh: DeviceMesh, cfg, dump_dir=None):
    """``apply_layout``'s compile + FSDP step for ``parallel.fsdp_impl = compiled``: returns a ``Compiled``."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.dist.comm_overlap import active_trace, instrument_graph

    def traced(gm) -> None:
        # After the passes, before lowering: route collectives through the comm trace (when one runs).
        if active_trace() is not None:
            instrument_graph(gm)

    backend = AccelrunBackend(CompileOptions.from_config(cfg, dump_dir=dump_dir if cfg.dump else None))
    backend.before_lowering.append(traced)
    done = apply_compiled_fsdp(model, blocks, mesh, backend, fullgraph=cfg.fullgraph)
    what = (f"the whole model with accelrun and compiled FSDP ({len(done.units)} units, {done.params} sharded "
            f"parameters gathered in the graph and kept for the backward, as with reshard_after_forward: false)")
    return Compiled(what, backend.record, backend)

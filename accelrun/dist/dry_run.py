"""A job's layout built for its ranks here, without their devices: what each rank would hold.

For each rank, one after the other in this process: a fake process group of the job's world size
(torch's ``fake`` backend: collectives return at once, no peers), the job's device mesh, the model built
on the meta device, and the layout the trainer applies: its pipeline stages, then ``apply_layout``
(tensor and sequence parallelism, activation checkpointing, compile wrappers, FSDP/HSDP or compiled
FSDP). Nothing is materialised: each rank's parameter shards are meta tensors whose shapes give its
bytes. Parameters are fp32 (the trainer's master weights), as are their gradients and AdamW's two
moments.

Ranks that differ only in their data-parallel coordinates hold shards of the same sizes except where
a parameter's rows do not divide evenly, which shows in the first and the last data-parallel rank; the
same holds for tensor-parallel ranks; and pipeline ranks of one kind (the same layers per stage, neither
or both ends) hold the same. So by default the first and the last data-parallel rank are built for the
first and the last tensor-parallel rank of one pipeline rank of each kind (``dry_run_ranks``: 16 of
Llama 3 405B's 512 ranks on TP 8 × PP 8 × FSDP 8), and ``ranks=`` asks for others (or all).

>>> from accelrun.config import load_config                          # doctest: +SKIP
>>> dry_run(load_config("configs/llama.yaml", ["parallel.nproc_per_node=2", "parallel.dp_shard=2"]))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from accelrun.config import ResolvedConfig
from accelrun.dist.context import ParallelContext
from accelrun.dist.mesh import MESH_DIMS, build_mesh, dp_coordinates
from accelrun.errors import UserError
from accelrun.plan.stage_split import layer_ranges, recipe_stage_layers

FP32 = 4
ADAMW_STATES = 2  # exp_avg, exp_avg_sq, fp32 like the parameter


@dataclass(frozen=True)
class RankBytes:
    rank: int
    coords: dict[str, int]  # this rank's place on each mesh dimension
    params: int  # parameter elements this rank holds (its shards, its stages)
    stages: list[int] = field(default_factory=list)  # pipeline stages (empty without pipelining)

    @property
    def param_bytes(self) -> int:
        return FP32 * self.params

    @property
    def grad_bytes(self) -> int:
        return FP32 * self.params

    @property
    def optimizer_bytes(self) -> int:
        return ADAMW_STATES * FP32 * self.params


def representative_ranks(degrees: dict[str, int], pp_ranks: Iterable[int] | None = None) -> list[int]:
    """The first and last data-parallel rank of the first and the last tensor-parallel rank of each
    pipeline rank (``pp_ranks``: only these), context parallel rank 0: cp ranks hold FSDP shards like
    dp_shard's, the last one with the last dp rank."""
    degrees = {"cp": 1, **degrees}  # a layout without context parallelism may leave it out
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    ranks = set()
    for pp in range(degrees["pp"]) if pp_ranks is None else pp_ranks:
        for tp in sorted({0, degrees["tp"] - 1}):
            for d in {0, dp - 1}:
                rep, shard = divmod(d, degrees["dp_shard"])
                cp = 0 if d == 0 else degrees["cp"] - 1
                coords = {"pp": pp, "dp_replicate": rep, "dp_shard": shard, "cp": cp, "tp": tp}
                rank = 0
                for dim in MESH_DIMS:  # row-major over the mesh, outermost first
                    rank = rank * degrees[dim] + coords[dim]
                ranks.add(rank)
    return sorted(ranks)


def distinct_pipeline_ranks(resolved: ResolvedConfig) -> list[int]:
    """The first pipeline rank of each kind: the layers of each stage it runs, and whether it runs the
    model's first or last stage (the embedding, the output layer). Ranks of one kind hold the same."""
    par = resolved.config.parallel
    pp = par.degrees()["pp"]
    if pp == 1:
        return [0]
    n_stages = pp * par.stages_per_rank
    layers = layer_ranges(recipe_stage_layers(resolved.config))
    first_of_kind: dict[tuple, int] = {}
    for rank in range(pp):
        held = range(rank, n_stages, pp)  # rank r runs stages r, r + pp, ...
        kind = (tuple(len(layers[s]) for s in held), 0 in held, n_stages - 1 in held)
        first_of_kind.setdefault(kind, rank)
    return sorted(first_of_kind.values())


def dry_run_ranks(resolved: ResolvedConfig) -> list[int]:
    """The ranks a dry run builds by default: ``representative_ranks`` of each kind of pipeline rank."""
    return representative_ranks(resolved.config.parallel.degrees(), distinct_pipeline_ranks(resolved))


def dry_run(resolved: ResolvedConfig, ranks: Iterable[int] | None = None) -> list[RankBytes]:
    """Build the recipe's layout for ``ranks`` (default: ``dry_run_ranks``) and count what each holds.

    Only the built-in model families (a user's model is built whole by its factory, on a device)."""
    from accelrun.torch_private import FakeStore  # registers the "fake" backend

    cfg = resolved.config
    if cfg.model.custom is not None:
        raise ValueError("a dry run builds the built-in model families only (model.custom is set)")
    if dist.is_initialized():
        raise RuntimeError("a dry run needs this process without a process group of its own")
    world = cfg.parallel.world_size
    out = []
    for rank in ranks if ranks is not None else dry_run_ranks(resolved):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            out.append(_one_rank(resolved, rank, world))
        finally:
            dist.destroy_process_group()
    return out


def _one_rank(resolved: ResolvedConfig, rank: int, world: int) -> RankBytes:
    import tempfile
    from pathlib import Path

    from accelrun.dist.expert_parallel import apply_expert_parallel
    from accelrun.dist.layout import apply_layout
    from accelrun.dist.pipeline import Pipeline, microbatch_loss
    from accelrun.models import build_model
    from accelrun.plan.stage_split import recipe_end_costs

    cfg = resolved.config
    mesh = build_mesh(cfg.parallel, "cpu", world)
    dp_rank, dp_size = dp_coordinates(mesh)
    meta = torch.device("meta")
    ctx = ParallelContext(rank, world, rank % cfg.parallel.nproc_per_node, meta, mesh, dp_rank, dp_size,
                          tp_size=mesh["tp"].size(), pp_size=mesh["pp"].size(), cp_size=mesh["cp"].size())
    model = build_model(cfg.model, meta)
    parts, stages = [model], []
    if ctx.pp_size > 1:
        pipeline = Pipeline(model, mesh, cfg.parallel.pp_schedule, cfg.parallel.microbatches or ctx.pp_size,
                            microbatch_loss(cfg.grad_accum), meta, layers=cfg.parallel.pp_layers,
                            stages_per_rank=cfg.parallel.stages_per_rank, ends=recipe_end_costs(cfg))
        parts, stages = pipeline.modules, pipeline.stage_ids
    if cfg.parallel.ep > 1:  # as train's setup: experts placed before FSDP, which then leaves them alone
        apply_expert_parallel(model, mesh, cfg.parallel.ep, dp_size)
    with tempfile.TemporaryDirectory() as dump:  # compile dumps, if the recipe asks: none is compiled here
        for part in parts:
            apply_layout(part, cfg, ctx, Path(dump))
    held = {}
    for part in parts:
        for p in part.parameters():
            held[id(p)] = (p._local_tensor if isinstance(p, DTensor) else p).numel()
    coords = {d: mesh[d].get_local_rank() for d in MESH_DIMS}
    return RankBytes(rank, coords, sum(held.values()), list(stages))


def planned_params(resolved: ResolvedConfig, row: RankBytes) -> float:
    """Parameter elements ``accelrun plan`` counts for this rank (its ``parameters (fp32)`` term / 4):
    its pipeline stage's share, divided by FSDP's shard degree. A rank between the first and the last
    counts its own layers (the plan's ``middle`` term is the busiest of them)."""
    from dataclasses import replace

    from accelrun.plan.memory import stage_params
    from accelrun.plan.moe import held_params
    from accelrun.plan.workload import workload_from_config

    w = workload_from_config(resolved.config)
    if w.layout.pp == 1:
        stage = "only"
    else:
        last = w.layout.pp * max(1, len(row.stages)) - 1
        stage = "first" if 0 in row.stages else "last" if last in row.stages else "middle"
    shard = w.layout.dp_shard * w.layout.cp if w.layout.fsdp else 1  # FSDP shards over dp_shard × cp
    params = stage_params(w, stage)
    if stage == "middle":
        params = replace(params, layers=w.layout.rank_layers(row.coords["pp"]))
    return held_params(w, params.local, shard)  # parallel.ep: whole experts per rank


def format_dry_run(resolved: ResolvedConfig, rows: list[RankBytes]) -> list[str]:
    """One line per rank built: where it sits (with pipelining, the stages it runs and their layers), what
    it holds, and the plan's parameter bytes; with pipelining, a last line with every stage's layers."""
    from accelrun.report.fmt import nbytes

    ranges = layer_ranges(recipe_stage_layers(resolved.config)) if any(r.stages for r in rows) else []
    width = max((len(_stages(r)) for r in rows if r.stages), default=0)
    layers_width = max((len(_layers(r, ranges)) for r in rows if r.stages), default=0)
    staged = f" {'stages':>{max(width, 6)}} {'layers':>{max(layers_width, 6)}}" if width else ""
    lines = [f"{'rank':>5} {'pp':>3} {'rep':>3} {'shard':>5} {'cp':>3} {'tp':>3}{staged}  {'params':>10} {'grads':>10} "
             f"{'AdamW m,v':>10}  {'plan params':>11} {'ratio':>6}"]
    for r in rows:
        c = r.coords
        plan = FP32 * planned_params(resolved, r)
        stages = f" {_stages(r):>{max(width, 6)}} {_layers(r, ranges):>{max(layers_width, 6)}}" if width else ""
        lines.append(f"{r.rank:>5} {c['pp']:>3} {c['dp_replicate']:>3} {c['dp_shard']:>5} {c['cp']:>3} {c['tp']:>3}{stages}  "
                     f"{nbytes(r.param_bytes):>10} {nbytes(r.grad_bytes):>10} {nbytes(r.optimizer_bytes):>10}  "
                     f"{nbytes(int(plan)):>11} {r.param_bytes / plan if plan else float('nan'):>6.3f}")
    ratios = [r.param_bytes / p for r in rows if (p := FP32 * planned_params(resolved, r))]
    if any(abs(x - 1) > 0.01 for x in ratios):
        lines.append("ratio: the plan counts a shard's mean; FSDP cuts each parameter's first dimension into pieces "
                     "of ceil(rows / shards) rows, so the last shard ranks hold less (and the first slightly more)")
    if ranges:
        how = "parallel.pp_layers" if resolved.config.parallel.pp_layers is not None else (
            "automatic: balanced, the embedding and the output layer counted in blocks")
        lines.append(f"layers per stage ({how}): {','.join(str(len(r)) for r in ranges)}")
    return lines


def plan_verdict(resolved: ResolvedConfig) -> str | None:
    """The planner's memory verdict for the recipe on its cluster ("fits: ..." or "does not fit: ..."), or
    None where it cannot plan it (no cluster described, an uncalibrated CPU). The dry run counts what each
    rank holds of the model and its optimizer; whether it fits beside the activations is the plan's (a
    trial's 8B without checkpointing: "ratio 1.000" here, exit 0, where `plan` said it needs 132 GiB)."""
    from accelrun.plan.predict import predict

    try:
        return predict(resolved.config).verdict
    except Exception:  # noqa: BLE001 (the dry run's own figures stand; `accelrun plan` says why it cannot)
        return None


def _stages(row: RankBytes) -> str:
    return ",".join(map(str, row.stages))


def _layers(row: RankBytes, ranges: list[range]) -> str:
    """The layers of each of the row's stages, in its stages' order: ``0-6,63-70``."""
    return ",".join(f"{ranges[s][0]}-{ranges[s][-1]}" if len(ranges[s]) > 1 else str(ranges[s][0])
                    for s in row.stages)


def main(argv: list[str] | None = None) -> int:
    """``python -m accelrun.dist.dry_run CONFIG [key=value ...] [--all-ranks]``: print each rank's bytes."""
    import sys
    import time

    from accelrun.config import load_config

    args = list(sys.argv[1:] if argv is None else argv)
    every = "--all-ranks" in args
    args = [a for a in args if a != "--all-ranks"]
    t0 = time.perf_counter()
    try:  # a recipe the trainer would refuse: its message and exit code 2, as `accelrun train` gives
        resolved = load_config(args[0], args[1:])
        rows = dry_run(resolved, range(resolved.config.parallel.world_size) if every else None)
    except UserError as e:
        for m in e.messages:
            print(f"error: {m}", file=sys.stderr)
        return 2
    for line in format_dry_run(resolved, rows):
        print(line)
    print(f"dry run: {len(rows)} of {resolved.config.parallel.world_size} ranks built in "
          f"{time.perf_counter() - t0:.0f} s (fp32 parameters, gradients and AdamW moments)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

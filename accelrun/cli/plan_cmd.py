"""``accelrun plan``: predicted memory, step time, throughput and MFU of a recipe on a cluster."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from accelrun.cli.common import err, out, overrides_argument, print_warnings
from accelrun.config import ConfigError
from accelrun.plan import PlanError, PlanOptions, load_plan_config, predict, resolve_cluster, search_layouts
from accelrun.plan import efficiency as eff
from accelrun.plan.accelerators import ACCELERATORS
from accelrun.plan.memory import GIB
from accelrun.plan.predict import Plan
from accelrun.plan.search import SearchResult
from accelrun.plan.workload import AC_MODES

# The exit code of a plan whose layout does not fit (with --search: no layout fits). 2 stays a bad recipe.
EXIT_DOES_NOT_FIT = 3


@click.command("plan")
@click.argument("config", metavar="[CONFIG]", required=False)
@overrides_argument
@click.option("--cluster", "cluster", metavar="NAME_OR_FILE",
              help="Cluster description: a name under recipes/cluster/ (h100-8x, cpu-local, ...) or a YAML file. "
                   "Replaces the recipe's cluster section.")
@click.option("--search", is_flag=True, help="Search the layouts (degrees, micro-batch, checkpointing) on the cluster.")
@click.option("--top", default=5, show_default=True, type=click.IntRange(min=1), help="Layouts --search shows.")
@click.option("--ac", "ac", type=click.Choice(AC_MODES),
              help="Model this activation checkpointing instead of the recipe's (train.activation_checkpoint.mode; "
                   "'selective' is torchtitan's per-op policy).")
@click.option("--json", "as_json", is_flag=True, help="Print the prediction as JSON.")
@click.option("--calibrate", is_flag=True,
              help="Measure this machine (matmuls, attention, memory, collectives: its GPUs with NCCL where it "
                   "has CUDA GPUs, else its CPU with gloo) and write a cluster description; with CONFIG, then plan "
                   "on it.")
@click.option("--devices-per-node", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --calibrate: devices to measure together (GPUs; or processes that share the CPU, each with "
                   "its share of cores).")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="With --calibrate: also write the description here (it is always kept in the cache).")
@click.option("--devices", "list_devices", is_flag=True, help="List the accelerator kinds a cluster can name.")
def command(config: str | None, overrides: tuple[str, ...], cluster: str | None, search: bool, top: int,
            ac: str | None, as_json: bool, calibrate: bool, devices_per_node: int, output: Path | None,
            list_devices: bool) -> None:
    """Predict a recipe's per-device memory, step time, tokens/s and MFU on a cluster.

    Memory is broken down term by term (weights, gradients, optimizer state, gathered FSDP
    parameters, activations under the checkpointing policy, loss, allocator reserve, runtime), time
    part by part (matmuls, attention, elementwise traffic, exposed communication, pipeline bubble,
    optimizer), with a verdict: fits, or does not fit and why. Datasheet figures are scaled by one
    fixed set of efficiency constants (accelrun/plan/efficiency.py); measured ones are used as they are.
    Exit code 0 when it fits (with --search: when some layout fits), 3 when it does not, 2 for a bad
    recipe or cluster.

    \b
    Examples:
      accelrun plan --calibrate                                  # measure this machine (cached)
      accelrun plan configs/llama.yaml --cluster cpu-local       # after --calibrate (exit 2 before)
      accelrun plan model/llama3-8b --cluster h100-8x train.seq_len=8192 train.micro_batch=1 \\
          train.global_batch=16 train.precision=bf16-mixed parallel.nproc_per_node=8 \\
          train.activation_checkpoint.mode=selective                # fits: exit 0 (3 when it does not)
      accelrun plan model/llama3-70b --cluster h100-8x cluster.nodes=4 train.precision=bf16-mixed --search
      accelrun plan --calibrate --devices-per-node 2 --output recipes/cluster/this-box-2.yaml
      accelrun plan --devices
    """
    if list_devices:
        _print_devices()
        return
    if calibrate:
        # with --json and a recipe, stdout holds the plan's JSON alone
        written = _calibrate(devices_per_node, output, show=not (as_json and config is not None))
        if config is None:
            return
        cluster = cluster or str(written)  # plan on what was just measured
    if config is None:
        raise ConfigError("accelrun plan needs CONFIG (a recipe file or name), or --calibrate, or --devices")
    loaded = load_plan_config(config, overrides, cluster)
    print_warnings(loaded.resolved.warnings)
    cfg = loaded.resolved.config
    options = PlanOptions(activation_checkpoint=ac)
    cl = resolve_cluster(cfg.cluster, cfg.parallel.nproc_per_node)
    result = search_layouts(loaded.composed, cl, options, top) if search else None
    try:
        plan = predict(cfg, options, cl)
    except PlanError as e:
        if not search:
            raise
        plan = None  # the recipe's own layout does not fit this cluster; the search still can
        err.print(f"[yellow]note:[/] {escape(e.messages[0])}")
    if as_json:
        out.print_json(json.dumps(_to_json(plan, result)))
    else:
        if plan is not None:
            _print_plan(plan, ac)
        if result is not None:
            _print_search(result, cl.describe())
    if not fits_somewhere(plan, result):
        # a script's `accelrun plan ... && accelrun train ...` stops here (a new user's finding: exit 0)
        sys.exit(EXIT_DOES_NOT_FIT)



def fits_somewhere(plan: Plan | None, result: SearchResult | None) -> bool:
    """The recipe's own layout fits, or (--search) some layout the search tried does."""
    return (plan is not None and plan.fits) or (result is not None and result.fitting > 0)


def _tflops(value: float) -> str:
    """Three significant figures: a CPU's 0.0412 TFLOP/s is not 0.0, an H100's 412.3 stays 412."""
    return f"{value:,.3g}" if value < 100 else f"{value:,.0f}"


def _calibrate(devices_per_node: int, output: Path | None, show: bool = True) -> Path:
    from accelrun.plan.calibrate import cache_path, calibrate, to_yaml  # imports torch when it measures
    from accelrun.report.machine_load import CpuWindow, busy_note

    err.print(f"measuring this machine as {devices_per_node} device(s): matmuls, attention, memory, collectives "
              "(about a minute) ...")
    window = CpuWindow()  # the probes' worker processes are this one's descendants: not counted as others
    description = calibrate(devices_per_node)
    share = window.others_share()
    if busy := busy_note(share, "the calibration", threads=1,
                         effect="its rates are lower than a quiet machine's, so plans made from it predict slower "
                                "steps; run --calibrate again when the machine is quiet"):
        err.print(f"[bold yellow]warning:[/] {escape(busy)}", highlight=False)
        # kept with the figures, so every plan made from them says so (a trial's plan was 3-4x slow, silently)
        description["cluster"]["calibration"]["others_cpu_share"] = round(share, 3)
    text = to_yaml(description)
    path = cache_path(devices_per_node, gpu=description["cluster"]["calibration"]["device_name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    written = [str(path)]
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
        written.insert(0, str(output))
    if show:
        out.print(text, markup=False, highlight=False)
    err.print(f"written: {escape(', '.join(written))} (cluster/cpu-local reads the cache)")
    return path


def _print_devices() -> None:
    table = Table(title="accelerator kinds (cluster.device)")
    for col in ("kind", "bf16 TFLOP/s", "fp32 TFLOP/s", "memory GiB", "memory GB/s", "link GB/s", "source"):
        table.add_column(col)
    for a in ACCELERATORS:
        p = a.peaks
        table.add_row(a.kind, f"{p.bf16_tflops:g}" if p.bf16_tflops else "-", f"{p.fp32_tflops:g}",
                      f"{a.memory_gib:g}", f"{a.memory_bandwidth_gbs:g}", f"{a.link_gbs:g}", escape(a.source))
    table.add_row("cpu", "measured", "measured", "measured", "measured", "measured", "accelrun plan --calibrate")
    table.add_row("custom", "declared", "declared", "declared", "declared", "declared", "the cluster description")
    out.print(table)


def _gib(b: float) -> str:
    return f"{b / GIB:,.2f}"


def _print_plan(plan: Plan, ac: str | None) -> None:
    w, cl, lay = plan.workload, plan.cluster, plan.workload.layout
    sh = w.shape
    out.print(f"[bold]plan[/]: {sh.family.capitalize()} {_params_said(sh.param_count())} params ({sh.n_layers} layers, dim {sh.dim}) "
              f"on {escape(cl.describe())}")
    out.print(f"  layout: world {lay.world} = pp {lay.pp} × dp_replicate {lay.dp_replicate} × dp_shard "
              f"{lay.dp_shard} × cp {lay.cp} × tp {lay.tp}; batch: global {w.global_batch} × seq {w.seq_len} = micro "
              f"{w.micro_batch} × accumulation {w.grad_accum} × dp {lay.dp}; {w.precision} ({w.mode}); "
              f"checkpointing {w.ac_mode}{' (--ac)' if ac else ''}; "
              f"{'compiled' if w.compiled else 'eager'}", markup=False)
    extras = []
    if lay.tp > 1:
        extras.append(f"sequence parallel {'on' if lay.sequence_parallel else 'off'}, "
                      f"loss parallel {'on' if lay.loss_parallel else 'off'}")
    if lay.pp > 1:
        extras.append(f"pipeline {lay.pp_schedule}, {lay.pp_microbatches} micro-batches of {w.chunk_batch} "
                      f"sequence(s) per flush, layers per rank {[lay.rank_layers(r) for r in range(lay.pp)]}")
    if lay.fsdp:
        extras.append(f"FSDP reshard_after_forward {'on' if lay.reshard_after_forward else 'off'}")
    if extras:
        out.print("          " + "; ".join(extras), markup=False)

    mem = Table(title=f"memory per device (peak: {plan.memory.phase}, stage {plan.memory.stage})")
    mem.add_column("term")
    mem.add_column("GiB", justify="right")
    mem.add_column("what", overflow="fold")
    for t in plan.memory.terms:
        mem.add_row(escape(t.name), _gib(t.bytes), escape(t.detail))
    mem.add_row("[bold]total[/]", f"[bold]{_gib(plan.memory.total)}[/]",
                f"of {_gib(plan.memory.capacity)} GiB; allocator peak {_gib(plan.memory.allocator_peak)} GiB")
    out.print(mem)

    tt = Table(title="step time per device")
    tt.add_column("part")
    tt.add_column("seconds", justify="right")
    tt.add_column("share", justify="right")
    for name, s in plan.time.parts.items():
        tt.add_row(escape(name), f"{s:.4g}", f"{s / plan.step_s:.0%}")
    tt.add_row("[bold]step[/]", f"[bold]{plan.step_s:.4g}[/]", "100%")
    out.print(tt)
    comm = ", ".join(f"{k} {v:.3g} s" for k, v in plan.time.comm_time.items() if v > 0)
    if comm:
        out.print(f"  communication before overlap: {comm}", markup=False)

    mfu = f"{plan.mfu:.1%}" if plan.mfu is not None else "unknown (no peak)"
    out.print(f"[bold]throughput[/]: {plan.tokens_per_s_per_device:,.0f} tokens/s per device, "
              f"{plan.tokens_per_s:,.0f} in total; {_tflops(plan.achieved_tflops_per_device)} TFLOP/s per device "
              f"(model FLOPs); MFU {mfu} of {escape(str(plan.time.rates.peak_tflops))} TFLOP/s "
              f"({escape(plan.time.rates.peak_source)})")
    style = "green" if plan.fits else "bold red"
    out.print(f"[{style}]{escape(plan.verdict)}[/]")
    for note in plan.notes:
        out.print(f"  note: {note}", markup=False)
    for line in plan.unmodelled:
        out.print(f"  not modelled: {line}", markup=False)

    figs = Table(title="cluster figures")
    for col in ("figure", "value", "source"):
        figs.add_column(col, overflow="fold")
    r = plan.time.rates
    rows = [*cl.figures, ("matmul rate", _curve(r.matmul_curve, "by width"), ""),
            ("attention rate", _curve(r.attention_curve, "by sequence length")
             + (f" at head dim {r.curve_head_dim}" if r.head_dim_curve else ""), "")]
    if r.head_dim_curve:
        rows.append(("attention rate by head dim", _curve(r.head_dim_curve, "by head dimension"),
                     f"scales the curve above to the model's head dim ({plan.workload.shape.head_dim})"))
    for name, value, source in [*rows, ("memory rate", f"{r.memory_gbs:.4g} GB/s", "")]:
        figs.add_row(escape(name), escape(value), escape(source))
    out.print(figs)
    measured = bool(cl.config.calibration.matmul_tflops)
    if not measured:
        out.print("  constants: " + ", ".join(f"{n} {v:g}" for n, v, _ in eff.describe()), markup=False)


def _curve(curve: tuple[tuple[int, float], ...], by: str) -> str:
    if len(curve) == 1:
        return f"{curve[0][1]:.4g} TFLOP/s"
    return ", ".join(f"{x}: {v:.3g}" for x, v in curve) + f" TFLOP/s {by}"


def _print_search(result: SearchResult, where: str) -> None:
    table = Table(title=f"best layouts on {escape(where)} ({result.fitting} fit of {result.valid} valid, "
                        f"{result.considered} tried)")
    for col in ("#", "tokens/s", "per device", "MFU", "GiB", "step s", "layout"):
        table.add_column(col, justify="right" if col != "layout" else "left")
    for i, c in enumerate(result.best, 1):
        p = c.plan
        table.add_row(str(i), f"{p.tokens_per_s:,.0f}", f"{p.tokens_per_s_per_device:,.0f}",
                      f"{p.mfu:.1%}" if p.mfu is not None else "-", _gib(p.memory.total), f"{p.step_s:.3g}",
                      escape(c.summary))
    out.print(table)
    for i, c in enumerate(result.best, 1):  # whole lines, to paste after the recipe
        out.print(f"  {i}: {c.line}", markup=False)
    if not result.best:
        out.print("[bold red]no layout fits[/]: try a smaller micro-batch or global batch, more devices, "
                  "or bf16-mixed precision")


def _to_json(plan: Plan | None, result: SearchResult | None) -> dict:
    def one(p: Plan) -> dict:
        return {
            "fits": p.fits, "verdict": p.verdict, "step_s": p.step_s,
            "tokens_per_s": p.tokens_per_s, "tokens_per_s_per_device": p.tokens_per_s_per_device,
            "achieved_tflops_per_device": p.achieved_tflops_per_device,
            "mfu": p.mfu, "peak_tflops": p.time.rates.peak_tflops, "peak_source": p.time.rates.peak_source,
            "layout": p.layout_summary(),
            "memory": {"total_gib": p.memory.total / GIB, "allocator_peak_gib": p.memory.allocator_peak / GIB,
                       "capacity_gib": p.memory.capacity / GIB, "phase": p.memory.phase, "stage": p.memory.stage,
                       "terms": {t.name: t.bytes / GIB for t in p.memory.terms},
                       "term_details": {t.name: t.detail for t in p.memory.terms}},
            "time_s": dict(p.time.parts), "communication_before_overlap_s": dict(p.time.comm_time),
            "notes": list(p.notes), "unmodelled": list(p.unmodelled),
        }

    data: dict = {"plan": one(plan) if plan is not None else None}
    if result is not None:
        data["search"] = {"considered": result.considered, "valid": result.valid, "fitting": result.fitting,
                          "best": [{"overrides": c.line, **one(c.plan)} for c in result.best]}
    return data


def _params_said(n: int) -> str:
    """1.77 M, 8.03 B (a debug model read "0.00177 B params": a trial's)."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M"

"""``accelrun compile explain | passes | executors``: accelrun's graph compiler, inspected."""

from __future__ import annotations

import json
import shlex
import sys

import click
from rich.markup import escape
from rich.table import Table

from accelrun.cli.common import config_argument, err, load, out, overrides_argument, print_wide


@click.group("compile")
def command() -> None:
    """Inspect accelrun's graph compiler: what its passes do to a recipe's training step.

    \b
    Examples:
      accelrun compile explain configs/llama.yaml compile.backend=accelrun
      accelrun compile explain configs/llama.yaml compile.passes=max compile.scope=loss
      accelrun compile passes
      accelrun compile executors
    """


@command.command("explain")
@config_argument
@overrides_argument
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1),
              help="Steps run after the compiling one, to time the compiled step.")  # fmt: skip
def explain_cmd(config: str, overrides: tuple[str, ...], steps: int) -> None:
    """Compile one training step and show what every pass did.

    Prints, per graph and pass, the ops before and after and what changed (patterns matched, regions
    formed, collectives seen); which executor took each fusion region and why the others declined;
    compile time per stage; graph breaks. Each fusion region is listed with the executor that took it
    and, for each executor before it in compile.executors, why it declined. Writes every graph before
    and after every pass as readable
    Python, the generated kernels and record.json to the run directory's compile/ folder.

    Runs on one process: a recipe's parallel layout is not applied.

    \b
    Examples:
      accelrun compile explain configs/llama.yaml compile.backend=accelrun
      accelrun compile explain configs/llama.yaml 'compile.passes=[dce, cse, partition_regions]'
      accelrun compile explain configs/llama.yaml 'compile.executors=[cpp, aten]' train.precision=bf16-mixed
      accelrun compile explain configs/llama.yaml parallel.fsdp_impl=compiled compile.passes=overlap

    With parallel.fsdp_impl = compiled, the model is sharded over a group of one process, so its graphs
    hold the all-gathers and reduce-scatters, and the schedule of those collectives is shown as a
    timeline (compute segments, ▶ issue, ◀ wait) before and after schedule_overlap.
    """
    from accelrun.compile import explain as ex
    from accelrun.config import ConfigError, load_config
    from accelrun.config.validate import source_of
    from accelrun.report.rundir import create_run_dir
    from accelrun.train.explain_step import explain_step

    # Explain is about accelrun's compiler whatever backend the recipe trains with: said, and a mistake
    # that adding it makes is said as explain's (a new user read "override 'compile.backend=accelrun'",
    # which they had not written).
    asked = load_config(config, list(overrides))
    if asked.config.compile.backend != "accelrun":
        where = source_of(("compile", "backend"), asked.sources)
        err.print(f"note: compile explain compiles with accelrun's compiler; compile.backend = "
                  f"{asked.config.compile.backend} ({escape(str(where))}) is not used here", highlight=False)
    try:
        resolved = load(config, (*overrides, "compile.backend=accelrun"))
    except ConfigError as e:
        raise ConfigError([f"{m} (compile explain compiles with accelrun: the override 'compile.backend=accelrun' "
                           "is its own)" for m in e.messages]) from None
    cfg = resolved.config
    if cfg.parallel.world_size > 1:
        err.print("note: the parallel layout is not applied: this compiles one process's step"
                  + (" (compiled FSDP over a group of one)" if cfg.parallel.fsdp_impl == "compiled" else ""))
    # (a name that already ends so, name=x-explain, is not doubled: runs/x-explain, not x-explain-explain)
    run_dir = create_run_dir(cfg.report.runs_dir, cfg.name if cfg.name.endswith("-explain") else f"{cfg.name}-explain")
    # A run folder like train's (the resolved recipe, the command), so `runs list` shows it.
    (run_dir / "config.yaml").write_text(resolved.to_yaml())
    (run_dir / "command.txt").write_text(shlex.join(["accelrun", *sys.argv[1:]]) + "\n")
    err.print(f"compiling one training step of {escape(cfg.name)} (run dir {run_dir}) ...")
    result = explain_step(resolved, run_dir, steady_steps=steps)
    record = result.record

    out.print(f"[bold]compiled:[/] {escape(result.compiled)}; {record.dynamo_graphs} Dynamo graph(s), "
              f"{sum(record.graph_breaks.values())} graph break(s)")  # fmt: skip
    for reason, n in record.graph_breaks.items():
        out.print(f"  graph break ×{n}: {escape(reason)}")
    from accelrun.compile.coverage import coverage_lines

    for line in coverage_lines(record):  # frames skipped, nothing compiled, fallbacks: never silent
        out.print(f"[yellow]{escape(line)}[/]" if line.startswith("warning") else escape(line))
    if traced := [f"{g}: {f}" for g, f in record.traced_functions.items() if f]:  # which code each gN is
        out.print("graphs traced from: " + "; ".join(escape(t) for t in traced))
    if line := record.numerics_line():  # compile.debug_numerics: passes in the table below; the lowerings here
        out.print(escape(line))
        for g in record.graphs:
            if g.lowering_numerics:
                out.print(f"  {escape(g.name)} lowered: {escape(g.lowering_numerics)}")
    table = Table("graph", "pass", "ops", "what changed", "time", title="passes", title_justify="left")
    table.columns[1].no_wrap = table.columns[0].no_wrap = True
    for row in ex.pass_rows(record):
        table.add_row(*map(escape, row))
    _print_table(table)
    if record.regions:
        table = Table("graph", "executor", "regions", "compile", title="fusion regions by executor",
                      title_justify="left")  # fmt: skip
        for row in ex.executor_rows(record):
            table.add_row(*row)
        _print_table(table)
        declines = ex.decline_reasons(record)
        if declines:
            table = Table("executor", "declined because", "regions", title="why executors declined",
                          title_justify="left")  # fmt: skip
            for who, why, n in declines:
                table.add_row(who, escape(why), str(n))
            _print_table(table)
        table = Table("graph", "region", "ops", "taken by", "declined by (why)", title="each region: who took it, "
                      "who declined and why", title_justify="left")  # fmt: skip
        shown = region_rows(record.regions, REGIONS_SHOWN)
        for row in shown:
            table.add_row(*map(escape, row))
        _print_table(table)
        if len(record.regions) > len(shown):
            out.print(f"… and {len(record.regions) - len(shown)} more regions in {result.dump_dir}/record.json")
    if record.fallbacks:
        table = Table("graph", "stage", "what", "why", title="fallbacks (compile.strict makes them errors)",
                      title_justify="left")  # fmt: skip
        for f in record.fallbacks:
            table.add_row(escape(f.graph), f.stage, escape(f.what), escape(f.reason))
        _print_table(table)
    for p in record.passes:  # the collectives' schedule (schedule_overlap), the buckets formed, ...
        if p.detail:
            out.print(f"[bold]{escape(p.graph)} · {escape(p.name)}[/]")
            out.print(escape(p.detail), highlight=False)
    collectives = {g.name: g.collectives for g in record.graphs if g.collectives}
    if collectives:
        out.print("collectives seen: " + "; ".join(f"{g}: {c}" for g, c in collectives.items()))
    table = Table("stage", "seconds", title="compile time", title_justify="left")
    for stage, secs in record.stage_seconds.items():
        table.add_row(stage, f"{secs:.2f}")
    rest = result.first_step_s - result.steady_step_s - sum(record.stage_seconds.values())
    # (negative where stages ran beside the step, kernels built on other threads: it read "0.00", a trial's)
    table.add_row("Dynamo capture and the rest (first step − above − a compiled step)",
                  f"{rest:.2f}" if rest >= 0 else "n/a: the stages above add up to more than the first step (some "
                  "ran beside it, on other threads)")
    table.add_row("first step (capture + compile + run)", f"{result.first_step_s:.2f}")
    table.add_row(f"compiled step (median, {result.threads} thread{'s' if result.threads != 1 else ''})",
                  f"{result.steady_step_s:.3f}")
    _print_table(table)
    from accelrun.report.machine_load import busy_note

    if (busy := busy_note(result.others_share, "these steps", effect="the times above are slower and vary more "
                          "than on a quiet machine; run explain again when it is quiet")) is not None:  # fmt: skip
        out.print(f"[bold yellow]warning:[/] {escape(busy)}", highlight=False)
    out.print(f"kernel cache (the regions' built kernels): {record.cache_hits} hit(s), {record.cache_misses} "
              f"miss(es); loss {result.loss:.4f}")
    if "off" in record.graph_cache:  # explain turns compile.dump on itself: every graph compiled afresh
        out.print("graph cache: not used (explain compiles every graph afresh, to show each pass)")
    (result.dump_dir).mkdir(parents=True, exist_ok=True)
    (result.dump_dir / "record.json").write_text(json.dumps(record.to_json(), indent=1))
    out.print(f"graphs before/after every pass, kernels and record.json: {result.dump_dir}/")


def _print_table(table: Table) -> None:
    """At the terminal's width on a terminal (cells fold); piped or logged, at the table's natural width
    (80 columns had cut cells short)."""
    if out.is_terminal:
        out.print(table)
    else:
        print_wide(table)


# Regions listed one per line by `compile explain` (a model's regions repeat per block; record.json has all).
REGIONS_SHOWN = 40
REGION_OPS_SHOWN = 4


def region_rows(regions: list, limit: int) -> list[tuple[str, str, str, str, str]]:
    """(graph, region, ops, executor that took it, each executor that declined it with why) for the first
    ``limit`` regions (``RegionRecord``s), in the order the partitioner formed them."""
    rows = []
    for r in regions[:limit]:
        ops = ", ".join(r.ops[:REGION_OPS_SHOWN]) + (", …" if len(r.ops) > REGION_OPS_SHOWN else "")
        declined = "; ".join(f"{who}: {why}" for who, why in r.declined.items()) or "-"
        rows.append((r.graph, str(r.region), f"{len(r.ops)} ({ops})", r.executor, declined))
    return rows


@command.command("passes")
def passes_cmd() -> None:
    """List the compiler's passes: stage, options and the presets that include each.

    \b
    Examples:
      accelrun compile passes
    """
    from accelrun.compile.passes.base import PRESETS, registered_passes

    table = Table("pass", "stage", "options (default)", "in presets", "what it does")
    for name, spec in sorted(registered_passes().items(), key=lambda kv: kv[1].stage):
        opts = option_defaults(spec.options)
        presets = ", ".join(p for p, names in PRESETS.items() if name in names) or "-"
        table.add_row(name, spec.stage, escape(opts), presets, escape(spec.doc))
    _print_table(table)
    out.print(escape("Use a preset (compile.passes=default|none|max), one less some of its passes "
                     "(compile.passes=default-remat-cpu_dropout), or a list: "
                     "'compile.passes=[dce, cse, {remat: {budget_mb: 64}}]'"))


def option_defaults(options: type) -> str:
    """A pass's options with their defaults, ``name=value, ...`` (a factory's value, not pydantic's marker
    for it), or ``-``."""
    return ", ".join(f"{k}={f.get_default(call_default_factory=True)!r}" for k, f in options.model_fields.items()) or "-"


@command.command("executors")
def executors_cmd() -> None:
    """List the executors and whether each can run on this machine.

    \b
    Examples:
      accelrun compile executors
    """
    from accelrun.compile.executors.base import registered_executors

    table = Table("executor", "available here", "what it does")
    for name, cls in registered_executors().items():
        why = cls().unavailable_reason()
        doc = (cls.__doc__ or (__import__(cls.__module__, fromlist=["_"]).__doc__ or "")).strip().splitlines()[0]
        table.add_row(name, "yes" if why is None else f"no: {escape(why)}", escape(doc))
    _print_table(table)

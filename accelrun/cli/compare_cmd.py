"""``accelrun compare``: runs side by side with confidence intervals, loss parity and config differences."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from accelrun.cli.common import err, out, print_wide
from accelrun.report.compare import FEW_REPEATS, Comparison, Group, compare_groups
from accelrun.report.compare_render import (
    diff_rows,
    marked,
    parity_lines,
    render_comparison_html,
    render_comparison_md,
    summary_table,
    unmarked,
)
from accelrun.report.files import write_json, write_text_atomic
from accelrun.report.rundata import RunRecord, load_run


def run_labels(runs: list[RunRecord]) -> list[str]:
    """Run names where they tell the runs apart, ``name/id`` where they do not."""
    names = [r.name for r in runs]
    return names if len(set(names)) == len(names) else [f"{r.name}/{r.path.name}" for r in runs]


@click.command("compare")
@click.argument("runs", nargs=-1, required=True, metavar="RUN_A RUN_B [RUN_C]...")
@click.option("--loss-rtol", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Relative tolerance for loss parity (default: 1e-3 for fp32 runs, 2e-2 with bf16).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Also write compare.md, compare.html and compare.json into this directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON instead of tables.")
def command(runs: tuple[str, ...], loss_rtol: float | None, out_dir: Path | None, as_json: bool) -> None:
    """Compare runs against the first: speed with 95% intervals, loss parity, config and machine.

    Each RUN is a run directory (runs/<name>/<time>-<id>) or a folder of runs, which stands for
    its newest run. The table gives median step time, tokens/s, MFU, peak memory and compile time
    over steady steps (warm-up, compile and profiled steps left out), and each run's speed against
    the first with a bootstrap 95% confidence interval. Loss parity says whether the loss curves
    agree within a tolerance, or the first step where they part. Every config key that differs is
    listed with where each run's value came from; different CPUs, GPUs or software are flagged.
    Exits 0 once the runs are compared, whatever they show (2: a run that cannot be read).

    \b
    Examples:
      accelrun compare runs/llama-debug/20261122-131155-f27524 runs/llama-debug/20261122-140210-9ac1e0
      accelrun compare runs/eager-run runs/inductor-run --out reports/eager-vs-inductor
      accelrun compare RUN_A RUN_B --loss-rtol 1e-4 --json > comparison.json
    """
    if len(runs) < 2:
        raise click.UsageError("give at least two runs to compare")
    records = [load_run(r) for r in runs]
    labels = run_labels(records)
    for rec, label in zip(records, labels, strict=True):
        rec.label = label
    c = compare_groups([Group(label, [rec]) for label, rec in zip(labels, records, strict=True)], rtol=loss_rtol)
    c.notes += newest_of_folders(runs, records)
    c.warnings += busy_runs(records)
    if out_dir is not None:  # first: a reader that stops early (`| head`) must not cost the files
        title = "accelrun compare: " + " vs ".join(labels)
        write_text_atomic(render_comparison_md(c, title=title), out_dir / "compare.md")
        write_text_atomic(render_comparison_html(c, title=title), out_dir / "compare.html")
        write_json(c.to_dict(), out_dir / "compare.json")
    if as_json:
        out.print_json(json.dumps(c.to_dict()))
    else:
        print_comparison(c)
    if out_dir is not None:
        err.print(f"wrote {escape(str(out_dir))}/compare.{{md,html,json}}", highlight=False)


def newest_of_folders(refs: tuple[Path, ...] | list[Path], records: list) -> list[str]:
    """Which run a folder of several stood for (its newest): a new user compared two folders and was not
    told which of the two runs in one of them was read."""
    from accelrun.report.rundir import runs_in

    out = []
    for ref, rec in zip(refs, records, strict=True):
        ref = Path(ref).expanduser()
        held = [r for r in runs_in(ref) if (r / "metrics.jsonl").is_file()] if ref.is_dir() else []
        if ref.resolve() != Path(rec.path).resolve() and len(held) > 1:  # (the runs it could have read)
            out.append(f"{ref} holds {len(held)} runs: compared its newest, {rec.path.name} (name a run folder to "
                       "compare another)")
    return out


def busy_runs(records: list) -> list[str]:
    """Runs that trained beside a busy neighbour (their reports say how busy): their speed is the
    machine's, not the settings' (a new user compared a run that took 1 of 2 cores beside one with
    nothing said). `ab` measures this itself, per repeat."""
    from accelrun.report.machine_load import BUSY_WARNING

    out = []
    for rec in records:
        load = (rec.report or {}).get("machine_load") or {}
        share, threads = load.get("others_cpu_share"), load.get("threads")
        if isinstance(share, (int, float)) and share > BUSY_WARNING:
            on = f" (it ran on {threads} thread{'s' if threads != 1 else ''})" if threads else ""
            out.append(f"{rec.label}: other processes used {share:.0%} of the machine's CPU while it trained{on}: "
                       "its speed figures are slower than on a quiet machine")
    return out


def print_comparison(c: Comparison) -> None:
    """The comparison on the terminal: figures, parity, config differences, warnings."""
    headers, rows = summary_table(c)
    t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        t.add_row(*(escape(v) for v in row))
    print_wide(t)
    if marked(c):  # the mark said, where it shows
        out.print("[dim]* the 95% interval excludes 1: a difference the interval sees[/]", highlight=False)
    if unmarked(c):
        out.print(f"[dim]intervals over fewer than {FEW_REPEATS} runs a row resample one process's steps: a new "
                  f"process's pace moves more, so they are not marked (accelrun ab --repeats {FEW_REPEATS} or more, "
                  "or compare folders of repeats)[/]", highlight=False)
    out.print(f"\n[bold]loss parity[/] (relative tolerance {c.rtol:g})")
    for line in parity_lines(c):
        out.print("  " + escape(line), highlight=False)
    out.print("\n[bold]config differences[/]" + ("" if c.diff else ": none"))
    if c.diff:
        headers, rows = diff_rows(c)
        t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
        for h in headers:
            t.add_column(h, overflow="fold")
        for row in rows:
            t.add_row(*(escape(v) for v in row))
        print_wide(t)
    for w in c.warnings:
        out.print("[bold yellow]warning:[/] " + escape(w), highlight=False)
    for n in c.notes:
        out.print("[dim]note:[/] " + escape(n), highlight=False)

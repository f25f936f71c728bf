"""``accelrun runs list``: past runs with their key figures."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.core import ParameterSource
from rich.markup import escape
from rich.table import Table

from accelrun.cli.common import out, print_wide
from accelrun.report import fmt
from accelrun.report.peak import BUSY_PEAK
from accelrun.report.rundir import holds_runs
from accelrun.report.runs_index import RunRow, list_run_rows

STATUS_STYLE = {"finished": "green", "running": "cyan", "interrupted": "yellow", "diverged": "red", "crashed": "red",
                "continued": "dim", "failed": "red", "losses differ": "yellow"}
# How a continued folder had ended, after its status: a crash stays in sight once a later run went on.
CONTINUED_AFTER = {"crashed": " after a crash", "interrupted": " after an interruption"}


@click.group("runs")
def command() -> None:
    """Look at past runs.

    \b
    Examples:
      accelrun runs list
      accelrun runs list --name llama-debug --limit 5
      accelrun runs list /shared/team-runs --json    # another runs folder (exit 2 where there is none)
    """


@command.command("list")
@click.argument("runs_dir", required=False, default="runs", type=click.Path(path_type=Path))
@click.option("--name", default=None, help="Only runs of this recipe name (the `name:` key).")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N runs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of a table.")
def list_cmd(runs_dir: Path, name: str | None, limit: int, as_json: bool) -> None:
    """List runs under RUNS_DIR (default: ./runs, the default report.runs_dir), newest first.

    Each row: kind (train; explain: a `compile explain` run; ab: an `accelrun ab` comparison, whose variants'
    runs `accelrun runs list <its folder>/runs` lists; its status: finished, losses differ (exit 4: its
    ab.md says why), failed (a variant's run failed), interrupted or running), the job's processes, status (finished, running, interrupted (killed or stopped), crashed, continued after a crash or
    an interruption (a later run took over its checkpoint), diverged; "segment k" for the k-th run of one history), steps, final loss, steady median
    step time, tokens/s, MFU, peak memory, compile backend, precision and config hash. A run that
    has no report.json and no live process is "interrupted": `checkpoint.resume: auto` continues it.

    \b
    Examples:
      accelrun runs list
      accelrun runs list --name llama-debug --limit 5
      accelrun runs list runs/llama-debug    # one recipe's runs, as compare takes them (exit 2 before any)
      accelrun runs list --json | jq -r 'select(.status == "finished") | .path'
    """
    one_name = False
    if not runs_dir.is_dir():
        if click.get_current_context().get_parameter_source("runs_dir") != ParameterSource.DEFAULT:
            what = "not a folder" if runs_dir.exists() else "no such folder"
            raise click.BadParameter(f"{runs_dir}: {what}", param_hint="RUNS_DIR")
    elif holds_runs(runs_dir):  # one recipe's runs: runs/llama-debug
        if name not in (None, runs_dir.name):
            raise click.BadParameter(f"{runs_dir} holds the runs named {runs_dir.name}, not {name}",
                                     param_hint="--name")
        runs_dir, name, one_name = runs_dir.parent, runs_dir.name, True
    rows = list_run_rows(runs_dir, name, limit, comparisons=not one_name)  # that folder's runs, not runs/ab's
    if as_json:
        for r in rows:
            out.print(json.dumps(r.to_dict()), markup=False, highlight=False, soft_wrap=True)
        return
    if not rows:
        out.print(f"no runs under {escape(str(runs_dir))}" + (f" named {escape(name)}" if name else ""))
        return
    t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for col, justify in (("run", "left"), ("kind", "left"), ("started (UTC)", "left"), ("status", "left"),
                         ("procs", "right"), ("steps", "right"),
                         ("final loss", "right"), ("step (median)", "right"), ("tokens/s (job)", "right"),
                         ("MFU", "right"), ("peak mem", "right"), ("compile", "left"), ("precision", "left"),
                         ("config", "left")):
        t.add_column(col, justify=justify, no_wrap=col == "run")
    for r in rows:
        style = STATUS_STYLE.get(r.status, "")
        status = escape(r.status) + CONTINUED_AFTER.get(r.continued_after or "", "") \
            + (f" (segment {r.segment})" if r.segment > 1 else "")
        t.add_row(escape(r.run), r.kind, r.started, f"[{style}]{status}[/]" if style else status,
                  str(r.processes) if r.processes is not None else "-", str(r.steps), fmt.num(r.final_loss), fmt.secs(r.step_time_s), fmt.integer(r.tokens_per_s),
                  _mfu_cell(r),
                  fmt.nbytes(r.mem_peak_bytes), escape(r.compile), escape(r.precision), escape(r.config_hash or "n/a"))
    print_wide(t)
    if any(r.mfu is not None and r.mfu > 1 for r in rows):
        out.print("> 100% MFU: the peak it divides by is too low; the run's report.md says why "
                  "(report.peak_tflops declares one)")
    if any(r.mfu_upper_bound and r.mfu is not None and r.mfu <= 1 for r in rows):
        out.print(f"≤ MFU: an upper bound: the CPU peak it divides by was {BUSY_PEAK} (other processes used the "
                  "CPU while it was probed), so it understates the machine")


def _mfu_cell(r: RunRow) -> str:
    """The MFU, "≤" where its peak was probed on a busy CPU; over 100% no figure, only that it is."""
    if r.mfu is not None and r.mfu > 1:
        return "> 100%"
    return ("≤ " if r.mfu_upper_bound and r.mfu is not None else "") + fmt.pct(r.mfu)

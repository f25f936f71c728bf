"""``accelrun ab``: run two (or more) settings as fresh interleaved processes and compare them."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click
from rich.markup import escape

from accelrun.cli.common import config_argument, err, load, out
from accelrun.cli.compare_cmd import print_comparison
from accelrun.report.ab import (
    BUSY_WARNING,
    AbPlan,
    RunEvent,
    Variant,
    pin_threads_to_free_cores,
    resolve_variants,
    run_ab,
    write_ab_reports,
)
from accelrun.report.fmt import secs
from accelrun.report.rundir import create_run_dir

VARIANT_OPTIONS = ("--a", "--b", "--c", "--d")


class VariantCommand(click.Command):
    """Lets ``--a k1=v1 k2=v2 --b k3=v3`` give a variant several overrides: every argument after a
    variant option, up to the next option, belongs to that variant (click alone would take one)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rewritten: list[str] = []
        current: str | None = None
        for arg in args:
            if arg in VARIANT_OPTIONS:
                current = arg
                continue
            if arg.startswith("-"):
                current = None
            if current is not None:
                rewritten += [current, arg]
            else:
                rewritten.append(arg)
        # `--a` or `--b` with nothing after it: that variant is the recipe as is (A/A runs measure noise).
        ctx.meta["variants_given"] = {opt for opt in VARIANT_OPTIONS if opt in args}
        return super().parse_args(ctx, rewritten)


def _mmss(s: float) -> str:
    m, sec = divmod(int(s), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m:02d}:{sec:02d}"


class Progress:
    """Which variant and repeat is running, its step lines, and elapsed time / estimate for the rest."""

    def __init__(self, plan: AbPlan):
        self.plan = plan
        self.started: dict[int, float] = {}
        self.durations: dict[str, list[float]] = {v.label: [] for v in plan.variants}

    def __call__(self, e: RunEvent) -> None:
        tag = f"{e.variant}{e.repeat}"
        if e.kind == "start":
            self.started[e.index] = e.elapsed_s
            err.print(f"[bold][{e.index}/{e.total}][/] variant [cyan]{escape(e.variant)}[/] repeat "
                      f"{e.repeat}/{self.plan.repeats}  (elapsed {_mmss(e.elapsed_s)})", highlight=False)
            err.print(f"  [dim]accelrun train {escape(e.text)}[/]", highlight=False)
        elif e.kind == "line":
            err.print(f"  {escape(tag)} │ {escape(e.text)}", highlight=False)
        else:
            took = e.elapsed_s - self.started.get(e.index, e.elapsed_s)
            self.durations[e.variant].append(took)
            busy = (f"; [yellow]other processes used {100 * e.other_cpu:.0f}% of the CPU meanwhile[/]"
                    if e.other_cpu is not None and e.other_cpu > BUSY_WARNING else "")
            err.print(f"  {escape(tag)} done in {took:.1f}s: {escape(_figures(Path(e.text)))}{busy}; "
                      f"elapsed {_mmss(e.elapsed_s)}, {self._eta(e.index)}", highlight=False)

    def _eta(self, index: int) -> str:
        rest = self.plan.schedule()[index:]
        if not rest:
            return "all runs done"
        if any(not self.durations[v.label] for _, v in rest):
            return "estimate after the first round"
        left = sum(sum(self.durations[v.label]) / len(self.durations[v.label]) for _, v in rest)
        return f"about {_mmss(left)} to go"


def _figures(run_dir: Path) -> str:
    try:
        r = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        return str(run_dir)
    return (f"median step {secs((r.get('step_time_s') or {}).get('median'))}, "
            f"compile {secs(r.get('compile_time_s'))}, final loss {r.get('final_loss', float('nan')):.4f}")


@click.command("ab", cls=VariantCommand)
@config_argument
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE | ~KEY]...")
@click.option("--a", "a", multiple=True, metavar="KEY=VALUE...", help="Overrides for variant A (the baseline; "
              "may be empty: the recipe as is). Every argument up to the next option belongs to A.")
@click.option("--b", "b", multiple=True, metavar="KEY=VALUE...",
              help="Overrides for variant B (may be empty, or equal A's: an A/A run measures the machine's noise).")
@click.option("--c", "c", multiple=True, metavar="KEY=VALUE...", help="Overrides for a third variant, C.")
@click.option("--d", "d", multiple=True, metavar="KEY=VALUE...", help="Overrides for a fourth variant, D.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Fresh processes per variant.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="train.steps for every run "
              "(default: the recipe's).")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=None,
              help="report.warmup_steps: first steps left out of the speed figures (default: the recipe's).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for the results (default: <report.runs_dir>/ab/<name>/<time>-<id>).")
@click.option("--loss-rtol", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Relative tolerance for loss parity (default: 1e-3 for fp32, 2e-2 with bf16).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the bootstrap resampling.")
def command(config: str, overrides: tuple[str, ...], a: tuple[str, ...], b: tuple[str, ...], c: tuple[str, ...],
            d: tuple[str, ...], repeats: int, steps: int | None, warmup_steps: int | None, out_dir: Path | None,
            loss_rtol: float | None, seed: int) -> None:
    """A/B test settings: is B faster than A, by how much, and do they still compute the same thing?

    Runs CONFIG (plus any common KEY=VALUE overrides) once per variant and repeat, each as a fresh
    `accelrun train` process, interleaved A B A B ..., with checkpoints off and resume off. Warm-up
    steps (report.warmup_steps), compiling and profiled steps are left out of the speed figures.
    Prints a table, a 95% bootstrap interval on the ratio of median step times (repeats resampled
    before steps), and a one-line verdict, such as "B is 1.23× faster than A (95% CI 1.19–1.27);
    losses agree" or "no significant difference: B at 1.04× A's speed (95% CI 0.99–1.09); about 2 more
    repeats could show its 4.0% difference, if it holds; losses agree".
    Writes ab.md, ab.html and ab.json, and warns when other processes competed for the CPU.

    \b
    Exit codes:
      0  done, and the losses of every run agree with A's
      4  done, but the losses disagree (the settings change what is computed)
      5  a variant's training process failed (its log is kept under logs/)
      2  a bad recipe or override, found before anything runs
      130  interrupted (Ctrl-C): the rounds every variant finished are compared and reported

    \b
    Examples:
      accelrun ab configs/llama.yaml --a compile.backend=eager --b compile.backend=accelrun --steps 60
      accelrun ab configs/llama.yaml --b compile.backend=inductor --repeats 5 --steps 40
      accelrun ab configs/llama.yaml train.threads=2 --a train.micro_batch=16 \\
          --b train.micro_batch=8 train.grad_accum=2 --warmup-steps 5
      accelrun ab configs/llama.yaml --a train.precision=fp32 --b train.precision=bf16-mixed --loss-rtol 0.05
      accelrun ab configs/llama.yaml --a --b --repeats 5 --steps 40   # A/A: the noise of this machine
    """
    given = click.get_current_context().meta.get("variants_given", set())
    if "--b" not in given:
        raise click.UsageError("Missing option '--b': B's overrides (an empty --b runs the recipe as is)")
    variants = [Variant(label, list(ov)) for label, ov in (("A", a), ("B", b), ("C", c), ("D", d))
                if label in ("A", "B") or ov or f"--{label.lower()}" in given]
    base = load(config, (*overrides, *a))  # prints the recipe's warnings once
    plan = AbPlan(config, variants, out_dir or Path("ab"), common=list(overrides), repeats=repeats, steps=steps,
                  warmup_steps=warmup_steps)
    # every variant valid before anything is created or run (exit 2 otherwise); the threads, said below
    pin_threads_to_free_cores(plan, resolve_variants(plan))
    if out_dir is None:
        out_dir = create_run_dir(Path(base.config.report.runs_dir) / "ab", base.config.name)
    elif (out_dir / "ab.json").exists():
        raise click.UsageError(f"{out_dir} already holds an ab result; choose another --out")
    plan.out_dir = out_dir
    err.print(f"[bold]accelrun ab[/]: {len(variants)} variants × {repeats} repeats = {len(plan.schedule())} runs, "
              f"interleaved; results in [cyan]{escape(str(out_dir))}[/]", highlight=False)
    for v in variants:
        err.print(f"  {v.label}: {escape(' '.join(v.overrides) or '(the recipe as is)')}", highlight=False)
    for note in plan.notes:
        err.print(f"[bold]note:[/] {escape(note)}", highlight=False)
    command_line = shlex.join(["accelrun", *sys.argv[1:]]) if sys.argv else ""
    if command_line:  # first: a comparison interrupted before any round finished still says what it was
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "command.txt").write_text(command_line + "\n", encoding="utf-8")
    result = run_ab(plan, Progress(plan), seed=seed, loss_rtol=loss_rtol)
    paths = write_ab_reports(result, command_line)
    out.print()
    print_comparison(result.comparison)
    out.print()
    for line in result.verdicts:
        out.print(f"[bold]{escape(line)}[/]", highlight=False)
    err.print("report: " + ", ".join(escape(str(p)) for p in paths), highlight=False)
    if result.interrupted_after is not None:
        err.print(f"interrupted: compared the {result.interrupted_after} round(s) of {plan.repeats} every variant "
                  f"finished (exit {result.exit_code})", highlight=False)
    if result.exit_code:
        sys.exit(result.exit_code)

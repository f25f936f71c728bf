"""What every command shares: the override arguments, loading a recipe, printing errors."""

from __future__ import annotations

import click
from rich.markup import escape
from rich.measure import Measurement

from accelrun.config import ResolvedConfig, load_config
from accelrun.consoles import DiagnosticConsole, ResultConsole
from accelrun.errors import UserError

# Results go to stdout (pipeable); progress, logs and errors to stderr.
out = ResultConsole(highlight=False, soft_wrap=True)
err = DiagnosticConsole(highlight=False, soft_wrap=True)

def print_wide(renderable) -> None:
    """Print at the table's natural width even when stdout is narrow or not a terminal, so a piped
    or logged table keeps one line per row instead of folding every cell."""
    natural = Measurement.get(out, out.options.update_width(10_000), renderable).maximum
    if natural <= out.width:
        out.print(renderable)
    else:  # Console.print(width=) cannot exceed the console's width: a wider console for this one
        ResultConsole(width=natural, highlight=False, file=out.file).print(renderable)


config_argument = click.argument("config", metavar="CONFIG")
overrides_argument = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE | ~KEY]...")


def load(config: str, overrides: tuple[str, ...]) -> ResolvedConfig:
    """Load and validate; print the recipe's warnings (values that have no effect, ...)."""
    resolved = load_config(config, list(overrides))
    print_warnings(resolved.warnings)
    return resolved


def print_user_error(e: UserError) -> None:
    for m in e.messages:
        err.print("[bold red]error:[/] " + escape(m))


def print_warnings(messages: list[str]) -> None:
    for m in messages:
        err.print("[bold yellow]warning:[/] " + escape(m))

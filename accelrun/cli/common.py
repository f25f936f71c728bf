"""What every command shares: the override arguments, loading a recipe, printing errors."""

from __future__ import annotations

import io

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
    if not out.is_terminal:
        # piped or logged: each line as long as its own text (rich pads every row to the widest one,
        # which a new user found filling `recipes list | less` with blanks)
        buffer = io.StringIO()
        ResultConsole(width=natural, highlight=False, file=buffer, color_system=None).print(renderable)
        # through the console, whose broken pipe (`| head`) is no error (consoles.ResultConsole)
        out.print("".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines()), markup=False,
                  highlight=False, soft_wrap=True, end="")
    elif natural <= out.width:
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


def override_hint(option: str) -> str | None:
    """For ``--steps`` given to a command that takes overrides: the recipe key it was probably meant as
    (``train.steps=VALUE``), or None when no key ends in that name."""
    from accelrun.config.errors import SYNONYMS
    from accelrun.config.schema import RunConfig
    from accelrun.report.rundata import flatten

    name = option.lstrip("-").replace("-", "_")  # (click gives the option without its =VALUE)
    name = SYNONYMS.get(name.lower(), name)  # --max-steps, --learning-rate: other tools' names
    keys = list(flatten(RunConfig().model_dump(mode="json")))
    matches = [k for k in keys if k == name] or sorted((k for k in keys if k.rpartition(".")[2] == name),
                                                       key=lambda k: (k.count("."), not k.startswith("train.")))
    if not matches:
        return None
    others = f" (or {', '.join(matches[1:3])})" if len(matches) > 1 else ""
    return f"recipe values are KEY=VALUE arguments, not options: did you mean {matches[0]}=VALUE{others}?"

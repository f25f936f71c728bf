"""``accelrun config show``: the resolved recipe, and where each value came from."""

from __future__ import annotations

import click

from accelrun.cli.common import config_argument, load, out, overrides_argument
from accelrun.config.resolve import explain_text


@click.group("config")
def command() -> None:
    """Inspect resolved recipes.

    \b
    Examples:
      accelrun config show configs/llama.yaml
      accelrun config show configs/llama.yaml train.steps=10 --explain
    """


@command.command("show")
@config_argument
@overrides_argument
@click.option("--explain", is_flag=True, help="Show each value's source: file:line, override or default.")
def show(config: str, overrides: tuple[str, ...], explain: bool) -> None:
    """Print the fully resolved recipe as YAML (extends merged, overrides applied, defaults filled).

    \b
    Examples:
      accelrun config show configs/llama.yaml
      accelrun config show configs/llama.yaml train.steps=10 --explain
      accelrun config show parallel/fsdp --explain
    """
    resolved = load(config, overrides)
    if not explain:
        out.print(f"# config hash {resolved.hash}", markup=False)
        out.print(resolved.to_yaml(), markup=False, end="")
        return
    out.print(f"# {resolved.config.name}  (config hash {resolved.hash})", markup=False)
    out.print(explain_text(resolved), markup=False, end="")

"""What every command shares: the override arguments, loading a recipe, printing errors."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from accelrun.config import ConfigError, ResolvedConfig, load_config

# Results go to stdout (pipeable); progress, logs and errors to stderr.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3

config_argument = click.argument("config", metavar="CONFIG")
overrides_argument = click.argument("overrides", nargs=-1, metavar="[KEY=VALUE | ~KEY]...")


def load(config: str, overrides: tuple[str, ...]) -> ResolvedConfig:
    return load_config(config, list(overrides))


def user_error_types() -> tuple[type[BaseException], ...]:
    """Errors a user causes and can fix: one message, exit 2, no traceback (unless --debug)."""
    kinds: list[type[BaseException]] = [ConfigError]
    # Only the packages already imported can have raised; importing them here would pull in torch.
    for module, name in (("accelrun.data.errors", "DataError"), ("accelrun.models.build", "ModelBuildError")):
        mod = sys.modules.get(module)
        if mod is not None:
            kinds.append(getattr(mod, name))
    return tuple(kinds)


def print_user_error(e: BaseException) -> None:
    messages = getattr(e, "messages", None) or str(e).splitlines() or [type(e).__name__]
    for m in messages:
        err.print(f"[bold red]error:[/] {m}", markup=True)

"""The ``accelrun`` command: a click group, one file per subcommand, user errors → exit code 2."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import click

from accelrun import __version__
from accelrun.cli.common import override_hint, print_user_error
from accelrun.consoles import quiet_stream
from accelrun.dist import stop
from accelrun.errors import UserError


def _started_as_the_command() -> bool:
    """Whether this process is the ``accelrun`` command (its script, ``python -m accelrun`` or ``-m
    accelrun.cli.main``), not a program that imports the CLI (tests through click's runner)."""
    main_file = Path(getattr(sys.modules.get("__main__"), "__file__", None) or "")
    return __name__ == "__main__" or main_file.name == "accelrun" or main_file.parts[-2:] == ("accelrun", "__main__.py")


# Before the subcommands' imports (most of the first second): a preemption then says so (exit 143).
if _started_as_the_command():
    stop.say_stop_outside_runs(next((a for a in sys.argv[1:] if not a.startswith("-")), ""))


class AccelrunGroup(click.Group):
    """Turns errors a user can fix into one message and their exit code (2; 3 for a diverged run), and
    Ctrl-C into 130; ``--debug`` shows the traceback."""

    def invoke(self, ctx: click.Context):
        try:
            result = super().invoke(ctx)
            _flush_stdout()
            return result
        except click.NoSuchOption as e:  # `train configs/x.yaml --steps 10`: say it is train.steps=10
            takes_overrides = e.ctx is not None and any(p.name == "overrides" for p in e.ctx.command.params)
            if e.option_name == "--debug":  # (a trial put it after the command)
                e.message, e.possibilities = ("No such option: --debug here: it goes before the command "
                                              "(accelrun --debug train ...), or set ACCELRUN_DEBUG=1"), None
            elif takes_overrides and (hint := override_hint(e.option_name)):
                e.message, e.possibilities = f"No such option: {e.option_name}. {hint}", None
            raise
        except KeyboardInterrupt:
            # Before a command catches signals itself (train does, once its run directory exists): the
            # shell's code for SIGINT, which schedulers read as "interrupted", where click's "Aborted!"
            # exits 1, a crash.
            if _debugging(ctx):
                raise
            again = " by a second Ctrl-C: stopped without saving a checkpoint" if stop.stopped_at_once() else ""
            click.echo(f"interrupted{again} (exit 130)", err=True)
            ctx.exit(130)
        except Exception as e:
            if isinstance(e, UserError):
                if _debugging(ctx):  # the traceback, and still the error's exit code (it was 1: a trial's)
                    traceback.print_exc()
                print_user_error(e)
                ctx.exit(e.exit_code)
            raise


def _debugging(ctx: click.Context) -> bool:
    """--debug or ACCELRUN_DEBUG=1: tracebacks as Python prints them."""
    return bool((ctx.obj or {}).get("debug")) or os.environ.get("ACCELRUN_DEBUG") == "1"


def _flush_stdout() -> None:
    """What is left of stdout's buffer, at the command's end. Only a closed stdout is forgiven here (the
    reader stopped: `... | head`); any other broken pipe is the command's own error and propagates."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stream(sys.stdout)


@click.group(cls=AccelrunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="accelrun")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors (also ACCELRUN_DEBUG=1).")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """accelrun: declarative training acceleration for PyTorch.

    \b
    Examples:
      accelrun train configs/llama.yaml
      accelrun train configs/llama.yaml train.steps=50 train.precision=bf16-mixed
      accelrun validate configs/llama.yaml parallel.nproc_per_node=4 parallel.tp=2
      accelrun config show configs/llama.yaml --explain
      accelrun recipes list
      accelrun ab configs/llama.yaml --a compile.backend=eager --b compile.backend=accelrun --steps 60
      accelrun compile explain configs/llama.yaml
      accelrun compare RUN_A RUN_B
      accelrun runs list
    """
    ctx.ensure_object(dict)["debug"] = debug


def _register() -> None:
    from accelrun.cli import (
        ab_cmd,
        compare_cmd,
        compile_cmd,
        config_cmd,
        data_cmd,
        export_cmd,
        generate_cmd,
        launch_cmd,
        plan_cmd,
        recipes_cmd,
        runs_cmd,
        slurm_cmd,
        train_cmd,
        validate_cmd,
    )

    for module in (train_cmd, validate_cmd, config_cmd, recipes_cmd, data_cmd, compare_cmd, ab_cmd, runs_cmd,
                   plan_cmd, launch_cmd, slurm_cmd, compile_cmd, export_cmd, generate_cmd):
        cli.add_command(module.command)


_register()


def main() -> None:
    cli(prog_name="accelrun")


if __name__ == "__main__":
    main()

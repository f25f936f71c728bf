"""``accelrun launch``: the command each node of a job runs, printed (it runs nothing)."""

from __future__ import annotations

import shlex

import click

from accelrun.cli.common import config_argument, load, out, overrides_argument


@click.command("launch")
@config_argument
@overrides_argument
@click.option("--dry-run", is_flag=True, help="Accepted for scripts that pass it: launch only ever prints the "
              "commands.")
@click.option("--rdzv-endpoint", default="NODE0_HOST:29500", show_default=True, metavar="HOST:PORT")
@click.option("--rdzv-id", default="JOB_ID", show_default=True)
def command(config: str, overrides: tuple[str, ...], dry_run: bool, rdzv_endpoint: str, rdzv_id: str) -> None:
    """Show the exact command every node of the recipe's job runs.

    \b
    Examples:
      accelrun launch configs/llama.yaml parallel.nnodes=2 parallel.nproc_per_node=8
      accelrun launch configs/llama.yaml parallel.nnodes=2 --rdzv-endpoint 10.0.0.1:29500

    It runs nothing: run each node's line there (or `accelrun slurm` for a SLURM allocation).
    """
    from accelrun.dist.launch_options import endpoint_problem
    from accelrun.dist.slurm import node_commands

    if rdzv_endpoint != "NODE0_HOST:29500" and (problem := endpoint_problem(rdzv_endpoint)) is not None:
        raise click.BadParameter(problem, param_hint="--rdzv-endpoint")  # (train refuses it: said here first)
    resolved = load(config, overrides)
    par = resolved.config.parallel
    cmds = node_commands(config, list(overrides), par.nnodes, rdzv_endpoint, rdzv_id)
    # (it refused to print without --dry-run while its help said it runs nothing: a trial's)
    out.print(f"# {par.nnodes} node(s) × {par.nproc_per_node} process(es) = world {par.world_size}; "
              f"degrees {par.degrees()}", markup=False)
    for i, cmd in enumerate(cmds):
        out.print(f"# node {i}", markup=False)
        out.print(shlex.join(cmd), markup=False)

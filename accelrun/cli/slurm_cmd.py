"""``accelrun slurm``: an sbatch script that runs a recipe on a SLURM allocation."""

from __future__ import annotations

from pathlib import Path

import click

from accelrun.cli.common import config_argument, load, out, overrides_argument

STOP_LEAD_S = 120  # accelrun.dist.slurm.STOP_LEAD_S, without importing torch for --help


@click.command("slurm")
@config_argument
@overrides_argument
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None, help="Write here (default: stdout).")
@click.option("--partition", default=None)
@click.option("--time", "time_limit", default=None, help="Wall-clock limit, e.g. 04:00:00.")
@click.option("--account", default=None)
@click.option("--gpus/--no-gpus", default=True, show_default=True, help="Ask for parallel.nproc_per_node GPUs per node.")
@click.option("--stop-lead", type=click.IntRange(min=1), default=STOP_LEAD_S, show_default=True, metavar="SECONDS",
              help="SIGTERM this long before the time limit (#SBATCH --signal=TERM@SECONDS): the ranks finish "
                   "their step, save a checkpoint and exit 143, and the job requeues itself.")
def command(config: str, overrides: tuple[str, ...], output: Path | None, partition: str | None,
            time_limit: str | None, account: str | None, gpus: bool, stop_lead: int) -> None:
    """Write an sbatch script for the recipe: one `accelrun train` per node under srun, which reads
    the allocation from SLURM's environment.

    \b
    Examples:
      accelrun slurm configs/llama.yaml parallel.nnodes=4 parallel.nproc_per_node=8 train.global_batch=64 -o job.sbatch
      sbatch job.sbatch
    """
    from accelrun.dist.slurm import sbatch_script

    resolved = load(config, overrides)
    c = resolved.config
    script = sbatch_script(config, list(overrides), name=c.name, nnodes=c.parallel.nnodes,
                           nproc_per_node=c.parallel.nproc_per_node, gpus=gpus, partition=partition,
                           time_limit=time_limit, account=account, stop_lead_s=stop_lead)
    if output is None:
        out.print(script, markup=False, end="")
    else:
        output.write_text(script)
        out.print(f"wrote {output}", markup=False)

"""``accelrun slurm``: an sbatch script that runs a recipe on a SLURM allocation."""

from __future__ import annotations

from pathlib import Path

import click

from accelrun.cli.common import config_argument, err, load, out, overrides_argument

STOP_LEAD_S = 120  # accelrun.dist.slurm.STOP_LEAD_S, without importing torch for --help


@click.command("slurm")
@config_argument
@overrides_argument
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None, help="Write here (default: stdout).")
@click.option("--partition", default=None)
@click.option("--time", "time_limit", default=None, help="Wall-clock limit, e.g. 04:00:00.")
@click.option("--account", default=None)
@click.option("--gpus/--no-gpus", default=None,
              help="Ask for parallel.nproc_per_node GPUs per node (default: unless the recipe's train.device is cpu).")
@click.option("--stop-lead", type=click.IntRange(min=1), default=STOP_LEAD_S, show_default=True, metavar="SECONDS",
              help="SIGTERM this long before the time limit (#SBATCH --signal=TERM@SECONDS): the ranks finish "
                   "their step, save a checkpoint and exit 143, and the job requeues itself.")
def command(config: str, overrides: tuple[str, ...], output: Path | None, partition: str | None,
            time_limit: str | None, account: str | None, gpus: bool | None, stop_lead: int) -> None:
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
    if gpus is None:  # a CPU recipe's job asked for GPUs, and would wait for ever on a CPU-only cluster
        gpus = c.train.device != "cpu"
    _check_time_covers_the_lead(time_limit, stop_lead)
    if (short := _lead_shorter_than_a_stop(c, stop_lead)) is not None:
        err.print(f"[bold yellow]warning:[/] {short}", highlight=False)  # stdout may be the script
    script = sbatch_script(config, list(overrides), name=c.name, nnodes=c.parallel.nnodes,
                           nproc_per_node=c.parallel.nproc_per_node, gpus=gpus, partition=partition,
                           time_limit=time_limit, account=account, stop_lead_s=stop_lead)
    if output is None:
        out.print(script, markup=False, end="")
    else:
        output.write_text(script)
        out.print(f"wrote {output}", markup=False)


def slurm_seconds(limit: str) -> int | None:
    """SLURM's --time in seconds ("MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS"), or None."""
    days, _, clock = limit.rpartition("-") if "-" in limit else ("0", "", limit)
    try:
        parts = [int(p) for p in clock.split(":")]
        d = int(days)
    except ValueError:
        return None
    if "-" in limit:  # D-HH[:MM[:SS]]
        parts = parts + [0] * (3 - len(parts))
    elif len(parts) == 1:  # MM
        parts = [0, parts[0], 0]
    elif len(parts) == 2:  # MM:SS
        parts = [0, *parts]
    if len(parts) != 3:
        return None
    h, m, sec = parts
    return ((d * 24 + h) * 60 + m) * 60 + sec


def _check_time_covers_the_lead(time_limit: str | None, stop_lead: int) -> None:
    from accelrun.errors import UserError

    if time_limit is None or time_limit.strip().upper() in ("0", "UNLIMITED", "INFINITE"):
        return  # SLURM's no limit
    total = slurm_seconds(time_limit)
    if total is None:
        raise UserError(f"--time {time_limit}: not a SLURM time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    if total <= stop_lead:
        raise UserError(f"--time {time_limit} is {total} s, no more than --stop-lead {stop_lead} s: SLURM would ask "
                        "the job to stop before it starts; give a longer --time or a shorter --stop-lead")


def _lead_shorter_than_a_stop(cfg, stop_lead: int) -> str | None:
    """A warning where the planner's step time says the ranks may not reach the host read at which they
    stop within the lead (on a GPU every report.read_every steps, by default log_every): a 70B recipe's
    10 steps of 11 s each took all but 9 of the default 120 s, before its checkpoint was written."""
    if cfg.cluster.device in (None, "cpu"):
        return None
    try:
        from accelrun.plan import predict

        step_s = predict(cfg).step_s
    except Exception:  # noqa: BLE001 (a recipe the planner cannot model: nothing to warn of)
        return None
    every = cfg.report.read_every or cfg.report.log_every
    waits = every * step_s
    if waits <= stop_lead / 2:
        return None
    return (f"a stop waits for the next host read, up to report.read_every = {every} steps of about {step_s:.1f} s "
            f"(the planner's) = {waits:.0f} s, and then writes a checkpoint, within --stop-lead {stop_lead} s: give "
            f"--stop-lead {int(2 * waits) + 60} or report.read_every={max(1, int(stop_lead / 2 / step_s))}")

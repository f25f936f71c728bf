"""``accelrun train``: validate a recipe, train, write the run directory and report."""

from __future__ import annotations

import shlex
import sys

import click

from accelrun.cli.common import config_argument, err, load, overrides_argument
from accelrun.config import ConfigError


@click.command("train")
@config_argument
@overrides_argument
def command(config: str, overrides: tuple[str, ...]) -> None:
    """Train the model a recipe describes and write a run directory with its report.

    CONFIG is a YAML file or a recipe name on the search path. Any number of KEY=VALUE
    overrides follow (values are YAML); ~KEY removes a key.

    \b
    Examples:
      accelrun train configs/llama.yaml
      accelrun train configs/llama.yaml train.steps=50 report.log_every=5
      accelrun train configs/llama.yaml train.precision=bf16-mixed compile.backend=inductor
      accelrun train configs/llama.yaml checkpoint.resume=none      # never resume

    Runs go to runs/<name>/<UTC time>-<id>/ (report.runs_dir). With checkpoint.resume=auto an
    interrupted run of the same recipe continues from its newest complete checkpoint.
    """
    resolved = load(config, overrides)
    world = resolved.config.parallel.world_size
    if world > 1:
        raise ConfigError(
            f"parallel.nnodes × parallel.nproc_per_node = {world}: launching several processes is not "
            "built yet in this version; set parallel.nproc_per_node=1 (recipe parallel/single) to train here"
        )
    from accelrun.train.run import train  # torch is imported only now

    command_line = shlex.join(["accelrun", *sys.argv[1:]]) if sys.argv else ""
    result = train(resolved, command=command_line, console=err)
    if result.status == "preempted":
        sys.exit(143)  # 128 + SIGTERM: the scheduler's convention for "terminated, may requeue"

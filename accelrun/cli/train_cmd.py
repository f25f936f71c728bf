"""``accelrun train``: validate a recipe, train (one process, or one per device), write the report."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import replace

import click
from rich.markup import escape

from accelrun.cli.common import config_argument, err, load, overrides_argument


@click.command("train")
@config_argument
@overrides_argument
@click.option("--nnodes", type=click.IntRange(min=1), default=None, help="Nodes in the job (sets parallel.nnodes).")
@click.option("--node-rank", type=click.IntRange(min=0), default=None,
              help="This node's number: node 0 hosts the rendezvous at --rdzv-endpoint. The ranks' numbers are "
                   "assigned at the rendezvous (torch's c10d), so global rank 0, which writes the run's report, may "
                   "run on any node.")
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="c10d rendezvous endpoint (several nodes).")
@click.option("--rdzv-id", default=None, help="Job id shared by all nodes of one job.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="Restarts of the whole group after a rank fails; it resumes from the newest checkpoint.")
@click.option("--local-addr", default=None, help="This node's address, when the host name resolves elsewhere.")
@click.option("--dry-run", is_flag=True, help="Build the job's real layout for its ranks here (meta tensors, a fake "
              "process group; no devices, no training) and print each rank's parameter, gradient and optimizer "
              "bytes beside the planner's; exit 2 for a layout the trainer would refuse.")
@click.option("--all-ranks", is_flag=True, help="With --dry-run: every rank, not one per distinct shard shape.")
def command(config: str, overrides: tuple[str, ...], nnodes: int | None, node_rank: int | None,
            rdzv_endpoint: str | None, rdzv_id: str | None, max_restarts: int, local_addr: str | None,
            dry_run: bool, all_ranks: bool) -> None:
    """Train the model a recipe describes and write a run directory with its report.

    CONFIG is a YAML file or a recipe name on the search path. Any number of KEY=VALUE
    overrides follow (values are YAML); ~KEY removes a key. When the recipe asks for more than one
    process (parallel.nproc_per_node × parallel.nnodes), accelrun starts them through torchrun's
    elastic agent: gloo on CPUs, NCCL on GPUs. Under SLURM (srun), the node count, this node's
    rank and the rendezvous come from the allocation.

    \b
    Examples:
      accelrun train configs/llama.yaml
      accelrun train configs/llama.yaml train.steps=50 report.log_every=5
      accelrun train configs/llama.yaml train.precision=bf16-mixed compile.backend=inductor
      accelrun train configs/llama.yaml parallel.nproc_per_node=2 parallel.dp_shard=2   # FSDP, 2 ranks
      accelrun train configs/llama.yaml parallel.nproc_per_node=2 parallel.dp_shard=1 parallel.tp=2 compile.backend=eager
      accelrun train configs/llama.yaml checkpoint.resume=none      # never resume
      accelrun train configs/llama.yaml model.custom=mypkg.models:build   # your own nn.Module (README: model.custom)
      accelrun train configs/llama.yaml parallel.nproc_per_node=4 parallel.tp=2 --dry-run   # what each rank holds

    Runs go to runs/<name>/<UTC time>-<id>/ (report.runs_dir). With checkpoint.resume=auto an
    interrupted run of the same recipe continues from its newest complete checkpoint.
    """
    if dry_run:
        _dry_run(config, (*overrides, *((f"parallel.nnodes={nnodes}",) if nnodes is not None else ())), all_ranks)
        return
    from accelrun.dist.launch_options import LaunchOptions
    from accelrun.dist.slurm import launch_from_slurm

    launch = LaunchOptions(node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                           max_restarts=max_restarts, local_addr=local_addr)
    slurm = launch_from_slurm(os.environ) if nnodes is None and rdzv_endpoint is None else None
    if slurm is not None:  # inside a SLURM job: its allocation says where this node stands
        nnodes, found = slurm
        launch = replace(found, max_restarts=max_restarts, local_addr=local_addr)
    if nnodes is not None:
        overrides = (*overrides, f"parallel.nnodes={nnodes}")
    # The recipe first: its mistakes are reported before torch and the launcher load (3.5 s against
    # 0.4 on the 2-core machine).
    resolved = load(config, overrides)
    if problems := launch.problems(resolved.config.parallel.nnodes):
        from accelrun.config import ConfigError

        raise ConfigError(problems)
    import torch

    from accelrun.dist.stop import exit_code
    from accelrun.dist.worker import rank_uses_cuda
    from accelrun.train.entry import train
    from accelrun.train.oom import oom_is_the_recipes
    from accelrun.train.traced_errors import named_model_errors

    command_line = shlex.join(["accelrun", *sys.argv[1:]]) if sys.argv else ""
    device = torch.device("cuda" if rank_uses_cuda(resolved.config) else "cpu")
    with (oom_is_the_recipes(resolved.config, device, "in training"),  # ranks of a job convert their own
          named_model_errors(resolved.config.compile.backend, resolved.config.compile.fullgraph)):
        result = train(resolved, command=command_line, console=err, launch=launch)
    if result.stopped is not None:  # 143 (SIGTERM), 130 (SIGINT): "terminated, may requeue"
        sys.exit(exit_code(result.stopped.signum))
    if result.status == "failed":
        sys.exit(1)


def _dry_run(config: str, overrides: tuple[str, ...], all_ranks: bool) -> None:
    import time

    from accelrun.cli.common import out

    resolved = load(config, overrides)
    from accelrun.dist.dry_run import dry_run, dry_run_ranks, format_dry_run, plan_verdict

    par = resolved.config.parallel
    ranks = list(range(par.world_size)) if all_ranks else dry_run_ranks(resolved)
    err.print(f"dry run: building the layout of {len(ranks)} of {par.world_size} ranks on meta tensors "
              "(a fake process group; nothing is allocated) ...", highlight=False)
    t0 = time.perf_counter()
    rows = dry_run(resolved, ranks)
    for line in format_dry_run(resolved, rows):
        out.print(line, markup=False, highlight=False)
    err.print(f"dry run: {len(rows)} of {par.world_size} ranks built in {time.perf_counter() - t0:.0f} s "
              "(fp32 parameters, gradients and AdamW moments)", highlight=False)
    if (verdict := plan_verdict(resolved)) is not None:  # with the activations: the planner's, on the recipe's cluster
        style = "" if verdict.startswith("fits") else "[bold yellow]warning:[/] "
        err.print(f"{style}memory with activations (accelrun plan): {escape(verdict)}", highlight=False)

"""SLURM: read a job's allocation from its environment, and write an sbatch script for a recipe.

Under ``srun`` every node runs ``accelrun train`` once; the node list, the node's index and the
job id give the rendezvous (the first node hosts it), so the same command line works on any
number of nodes.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from accelrun.dist.launch_options import RDZV_PORT, LaunchOptions
from accelrun.dist.stop import STOP_LEAD_ENV

STOP_LEAD_S = 120  # SIGTERM this long before the time limit: report.read_every steps and a checkpoint must fit


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[003-005,009],cpu01`` -> ``gpu003``."""
    m = re.match(r"([^,\[]*)(?:\[([^\]]+)\]([^,\[]*))?", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"cannot read SLURM node list {nodelist!r}")
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3) or ""
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix  # (a suffix after the brackets: ``a100-[01-02]-ib`` -> ``a100-01-ib``)


def launch_from_slurm(env: Mapping[str, str]) -> tuple[int, LaunchOptions] | None:
    """(nodes, launch options) of the SLURM job this process runs in, or None outside one."""
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env or "SLURM_JOB_NODELIST" not in env:
        return None
    nodes = int(env["SLURM_NNODES"])
    return nodes, LaunchOptions(
        node_rank=int(env.get("SLURM_NODEID", 0)),
        rdzv_endpoint=f"{first_host(env['SLURM_JOB_NODELIST'])}:{RDZV_PORT}",
        rdzv_id=f"slurm{env['SLURM_JOB_ID']}",
    )


def node_commands(config: str, overrides: list[str], nnodes: int, endpoint: str, job_id: str) -> list[list[str]]:
    """The exact `accelrun train` command each node runs."""
    base = ["accelrun", "train", config, *overrides]
    if nnodes == 1:
        return [base]
    return [[*base, "--nnodes", str(nnodes), "--node-rank", str(i), "--rdzv-endpoint", endpoint,
             "--rdzv-id", job_id] for i in range(nnodes)]


def sbatch_script(config: str, overrides: list[str], *, name: str, nnodes: int, nproc_per_node: int,
                  gpus: bool, partition: str | None, time_limit: str | None, account: str | None,
                  stop_lead_s: int = STOP_LEAD_S) -> str:
    """The script. Near its time limit (``stop_lead_s`` before) or when preempted, SLURM sends SIGTERM
    to every process of the step; the ranks go on to the loop's next host read (every step on a CPU,
    ``report.read_every`` steps on a GPU), save a checkpoint and exit 143, and the
    script puts the job back in the queue, where ``checkpoint.resume: auto`` continues it."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nnodes}",
             "#SBATCH --ntasks-per-node=1  # one accelrun per node; it starts one process per device",
             "#SBATCH --exclusive  # the whole node: its cores go to the ranks (srun below gives them to the task)"]
    if gpus:  # (train.device = auto asks for them: said on the line, as a CPU recipe's user read it)
        lines.append(f"#SBATCH --gpus-per-node={nproc_per_node}  # CPU nodes: accelrun slurm --no-gpus")
    for flag, value in (("partition", partition), ("time", time_limit), ("account", account)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --open-mode=append  # a requeued job adds to its log",
        f"#SBATCH --signal=TERM@{stop_lead_s}  # SIGTERM to every rank {stop_lead_s} s before the time limit: "
        "they go on to the next host read (report.read_every steps on a GPU) and save",
        "#SBATCH --requeue  # a preempted job goes back in the queue",
        "set -euo pipefail",
        f"export {STOP_LEAD_ENV}={stop_lead_s}  # accelrun warns when a stop took longer than this",
        "# accelrun reads the allocation (SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST, SLURM_JOB_ID):",
        f"# the first node hosts the c10d rendezvous on port {RDZV_PORT}.",
        "code=0",
        "# All the node's cores to the one task (srun would bind it to one CPU where cgroups constrain cores: its",
        "# 8 ranks and their data on one core); a node whose accelrun fails stops the others at once, not after",
        "# parallel.timeout_s in a collective.",
        'srun --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 '
        + shlex.join(["accelrun", "train", config, *overrides]) + " || code=$?",
        "# 143: stopped by SIGTERM after saving a checkpoint; queued again, the job resumes from it.",
        'if [ "$code" -eq 143 ]; then scontrol requeue "$SLURM_JOB_ID" || true; fi',
        'exit "$code"',
        "",
    ]
    return "\n".join(lines)

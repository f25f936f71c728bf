"""One rank of a multi-process job: ``run_rank(RUN_DIR)``, or ``python -m accelrun.dist.worker RUN_DIR``.

Started by the elastic agent (``accelrun.dist.launch``: forked, running ``run_rank``), which sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. The launcher has already written ``RUN_DIR/config.yaml``
(the resolved recipe); every rank reads it, joins the process group, builds its part of the
mesh and trains.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from accelrun.config import ConfigError, load_config
from accelrun.config.preflight import Machine, processes_fit, rank_threads
from accelrun.dist import stop
from accelrun.dist.collective import set_group_timeouts
from accelrun.dist.context import ParallelContext, env_rank
from accelrun.dist.mesh import build_mesh, dp_coordinates
from accelrun.dist.rank_errors import leave_record
from accelrun.dist.rank_failures import leave_crash, start_rank_log
from accelrun.errors import UserError
from accelrun.train.oom import oom_is_the_recipes


def machine_as_torch_sees_it() -> Machine:
    """This node's cores and the CUDA devices torch can use: the facts the preflight checks read."""
    return Machine(cores=os.cpu_count() or 1, cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0)


def rank_uses_cuda(cfg) -> bool:
    return torch.cuda.is_available() and cfg.train.device in ("auto", "cuda")


def cpu_rank_threads(nproc_per_node: int) -> int:
    return rank_threads(os.cpu_count() or 1, nproc_per_node)


def check_devices(cfg) -> None:
    """A job of CUDA ranks needs one GPU per process on every node: say so before anything starts."""
    fatal = [f.message for f in processes_fit(cfg, {}, machine_as_torch_sees_it()) if f.fatal]
    if fatal:
        raise ConfigError(fatal)


# NCCL settings a CUDA rank starts with unless the environment sets them: the flight recorder (the last
# collectives of every rank) on, dumped into the run directory when the watchdog sees a timeout, so a
# hung job leaves what each rank was waiting for. The watchdog's handling stays torch's default
# (tear the process down: a rank stuck in a collective cannot be trusted to go on); the agent's failure
# summary then shows the watchdog's message. TORCH_NCCL_BLOCKING_WAIT=1, set by the user, makes the
# timeout an exception in the training thread instead (the loop reports step and phase), at the cost
# of a host-blocking wait on every collective.
NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def nccl_environment(run_dir: Path | None) -> dict[str, str]:
    """The NCCL variables a CUDA rank sets for itself (those the environment does not set already)."""
    env = dict(NCCL_FLIGHT_RECORDER)
    if run_dir is not None:  # torch appends the rank to this prefix
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(run_dir / "nccl_flight_recorder" / "rank_")
    return {k: v for k, v in env.items() if k not in os.environ}


def init_rank(resolved, run_dir: Path | None = None) -> ParallelContext:
    cfg = resolved.config
    rank, world, local_rank = env_rank()
    use_cuda = rank_uses_cuda(cfg)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()} "
                              f"CUDA device(s) and parallel.nproc_per_node = {cfg.parallel.nproc_per_node}")
        torch.cuda.set_device(device)
        nccl = nccl_environment(run_dir)
        if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in nccl:
            Path(nccl["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
        os.environ.update(nccl)  # read when the NCCL process group is created, below
    if cfg.train.threads is None:
        # GPU ranks too: their host threads (data, the optimizer's CPU work, Python) share the node's cores.
        torch.set_num_threads(cpu_rank_threads(cfg.parallel.nproc_per_node))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    # Joining and setting up (rendezvous, building, loading, resuming) may take long on a big job; the
    # training steps' collectives get parallel.timeout_s once setup is done (train.run).
    timeout = timedelta(seconds=cfg.parallel.init_timeout_s)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=_store(rank, world, restarts, timeout),
                            rank=rank, world_size=world, timeout=timeout)
    mesh = build_mesh(cfg.parallel, device.type, world)
    set_group_timeouts(timeout)  # the mesh's own groups start with the backend's default
    dp_rank, dp_size = dp_coordinates(mesh)
    return ParallelContext(rank, world, local_rank, device, mesh, dp_rank, dp_size, tp_size=mesh["tp"].size(),
                           pp_size=mesh["pp"].size(), restart_count=restarts, cp_size=mesh["cp"].size())


def _store(rank: int, world: int, restarts: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this restart of the group.

    After the agent restarts the group, the store still holds the previous group's keys (among
    them each rank's gloo address); a new rank that read those would connect to a dead peer.
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_it, timeout=timeout)
    return dist.PrefixStore(f"accelrun/restart{restarts}", store)


def run_rank(run_dir: str, errors_dir: str | None = None) -> None:
    """The agent's entry point for a rank; exits with the rank's code (2: a user error) unless 0.
    A user error is also recorded in ``errors_dir`` for the launcher (``rank_errors``)."""
    folder = Path(errors_dir) if errors_dir else None
    with stop.catch_signals(watch=folder):  # first: the fork server left SIGTERM ignored (dist.fork_server)
        code = main([run_dir], errors_dir=folder)
    # Done: the rank only waits for the agent to collect it. A late Ctrl-C must not turn that into a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None, errors_dir: Path | None = None) -> int:
    from accelrun.train.run import run_in_dir

    run_dir = Path((argv or sys.argv[1:])[0])
    console = Console(stderr=True, highlight=False)
    rank, _, local_rank = env_rank()
    log = None
    with contextlib.suppress(OSError):  # no log (a read-only run folder) is no reason to fail here
        log = start_rank_log(run_dir, errors_dir, rank, local_rank)
    try:
        resolved = load_config(run_dir / "config.yaml", search_dirs=[])
        ctx = init_rank(resolved, run_dir)
        # Worded the same on every rank: the launcher shows a message no rank printed once, not per rank.
        with oom_is_the_recipes(resolved.config, ctx.device, "in training"):
            result = run_in_dir(resolved, run_dir, ctx, console if rank == 0 else None)
        if result.stopped is not None and errors_dir is not None:
            stop.leave_record(errors_dir, result.stopped)
    except UserError as e:
        prints = rank == 0 or getattr(e, "every_rank", False)
        if prints:
            for m in e.messages:
                console.print("[bold red]error:[/] " + escape(m))
        if errors_dir is not None:
            leave_record(errors_dir, rank, e.messages, printed=prints)
        return e.exit_code
    except (Exception, CheckpointException) as e:  # not the user's: traceback to the rank's log; the launcher explains
        leave_crash(errors_dir, log, rank, e)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

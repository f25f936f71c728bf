"""Start the ranks of a job through torchrun's elastic agent, called as a library.

The agent (``torch.distributed.launcher.elastic_launch``) does rendezvous (c10d), starts one
process per device running the entry point it is given (``accelrun.train.rank.run_rank``), watches them, and restarts the group
up to ``max_restarts`` times when one fails. One node without an endpoint is "standalone": a local
rendezvous on a free port, as ``torchrun --standalone`` does.

Ranks are forked from a multiprocessing fork server that has imported torch and accelrun once,
rather than started as fresh interpreters that each import them again: on a CPU host that import
costs several seconds of CPU per rank, more than a short job's training, and a restarted group
starts again from the same server. The server is a fresh process started (from this one's
environment) at the first launch of this process; it never touches a GPU, so forking from it is
safe for CUDA. Later launches from the same process reuse it, and with it its environment.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousGracefulExitError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from accelrun.config.schema import ParallelConfig
from accelrun.dist import stop
from accelrun.dist.launch_options import LaunchOptions
from accelrun.dist.rank_errors import unprinted_messages
from accelrun.dist.rank_failures import LOGS, culprit, exit_codes_of, explain, rank_ends
from accelrun.errors import UserError
from accelrun.torch_private import on_group_restart

# What the fork server imports once, before it forks ranks (with the entry point's own module).
FORKSERVER_PRELOAD = ["accelrun.dist.fork_server", "accelrun.dist.worker"]


def launch_config(par: ParallelConfig, opts: LaunchOptions) -> LaunchConfig:
    standalone = par.nnodes == 1 and opts.rdzv_endpoint is None
    rdzv_configs: dict = {"timeout": 900}
    if opts.node_rank is not None:
        rdzv_configs["rank"] = opts.node_rank
        # Node 0 hosts the c10d store at the endpoint. Said outright rather than inferred from host
        # names, which several nodes (containers, network namespaces) may share.
        if not standalone:
            rdzv_configs["is_host"] = opts.node_rank == 0
    return LaunchConfig(
        min_nodes=par.nnodes,
        max_nodes=par.nnodes,
        nproc_per_node=par.nproc_per_node,
        run_id=opts.rdzv_id or str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0" if standalone else (opts.rdzv_endpoint or ""),
        rdzv_configs=rdzv_configs,
        max_restarts=opts.max_restarts,
        monitor_interval=0.2,
        local_addr=opts.local_addr,
        start_method="forkserver",
        # SIGTERM and SIGINT are the launcher's (dist.stop): the ranks finish their step and save.
        signals_to_handle="SIGHUP,SIGQUIT",
    )


class RendezvousFailed(UserError):
    """This node could not join its job: an address or port nobody listens on, node 0 not started."""

    exit_code = 1  # not the recipe's: the same command may work once the other nodes are up


def rendezvous_failed(e: RendezvousError, opts: LaunchOptions) -> RendezvousFailed:
    def last_line(x: BaseException) -> str:
        return (str(x).strip().splitlines() or [type(x).__name__])[-1]

    cause = f" ({type(e.__cause__).__name__}: {last_line(e.__cause__)})" if e.__cause__ is not None else ""
    node = f"--node-rank {opts.node_rank}" if opts.node_rank is not None else "its rank from the rendezvous"
    return RendezvousFailed(
        f"this node ({node}) could not join the job's rendezvous at {opts.rdzv_endpoint}: {type(e).__name__}: "
        f"{last_line(e)}{cause}. Node 0 hosts it there: is it running, with the same job id (--rdzv-id), at an "
        "address and port this node reaches?")


@dataclass(frozen=True)
class JobOutcome:
    exit_code: int  # 0, the first failed rank's (2: a user error, 3: the loss diverged), 128 + a stop signal
    unprinted: list[str]  # user errors of ranks that no rank printed (see rank_errors)
    stopped: stop.Stopped | None = None  # rank 0's record when the ranks stopped on a signal
    ranks: int = 1
    failure: list[str] = field(default_factory=list)  # which rank failed first, how, its last lines


def _kill_ranks() -> None:
    """A second Ctrl-C: what the agent does on a signal it handles, with SIGKILL (a rank stuck in a
    collective would not take SIGTERM)."""
    raise SignalException("a second Ctrl-C", sigval=signal.SIGKILL)


# What the agent and torch's process context log: into the run folder, not onto the terminal.
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


@contextlib.contextmanager
def _agent_logs_to(path: Path) -> Iterator[None]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(path, delay=True)
    except OSError:  # a run folder that cannot be written: stay on the terminal
        yield
        return
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"))
    saved = []
    for name in AGENT_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate, logger.level))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, propagate, level in saved:
            logger.removeHandler(handler)
            logger.propagate, logger.level = propagate, level
        handler.close()


def restart_line(errors: Path, exit_codes: dict[int, int], restart: int, max_restarts: int) -> str:
    """What the launcher says as the agent restarts the group: which rank failed first and how, from the
    failed group's records (rank_failures), and which restart this is."""
    first = culprit(rank_ends(errors, exit_codes))
    failed = f"{first.described} (its log: {first.log})" if first else "a rank of this node's group failed"
    return (f"{failed}; restarting the ranks (restart {restart} of the {max_restarts} --max-restarts allows): "
            "they go on from the job's newest checkpoint, or from the start without one")


def launch_job(run_dir: Path, par: ParallelConfig, opts: LaunchOptions,
               entry: Callable[[str, str], None], say: Callable[[str], None] | None = None) -> JobOutcome:
    """Run the job to the end on this node's ranks, each calling ``entry(run_dir, errors_dir)`` (a module-level
    function: the fork server imports its module; ``train.rank.run_rank`` for training). ``say`` gets a
    line each time the agent restarts the group after a failure (``--max-restarts``)."""
    # Takes effect when the server starts (the first launch in this process).
    multiprocessing.set_forkserver_preload([*FORKSERVER_PRELOAD, entry.__module__])
    stop.set_launcher_identity()  # before the server starts: its ranks watch this process
    agent_log = run_dir / LOGS / "agent.log"

    def report_restart(exit_codes: dict[int, int], restart: int, max_restarts: int) -> None:
        line = restart_line(Path(errors), exit_codes, restart, max_restarts)
        logging.getLogger(AGENT_LOGGERS[0]).warning("accelrun: %s", line)  # into agent.log as well
        if say is not None:
            say(line)

    with (tempfile.TemporaryDirectory(prefix="accelrun-rank-errors-") as errors,
          stop.catch_signals(forward_to=Path(errors)), _agent_logs_to(agent_log), on_group_restart(report_restart)):
        try:
            with stop.abort_on_second_interrupt(_kill_ranks):
                elastic_launch(launch_config(par, opts), entry)(str(run_dir), errors)
        except RendezvousError as e:  # a C++ frame dump and torch's traceback, two minutes in, otherwise
            if isinstance(e, RendezvousGracefulExitError):
                raise
            raise rendezvous_failed(e, opts) from e
        except SignalException:  # _kill_ranks: the agent killed the ranks and stopped
            return JobOutcome(stop.exit_code(signal.SIGINT), [], stop.Stopped(0, signal.SIGINT, -1, None),
                              par.world_size)
        except ChildFailedError as e:
            exits = exit_codes_of(e)  # every rank's; the error names only the first the agent noticed
            codes = [c for c in exits.values() if c] or [f.exitcode for f in e.failures.values()]
            code = next((c for c in codes if c in (2, 3)), 1)
            return JobOutcome(code, unprinted_messages(Path(errors)),
                              failure=explain(Path(errors), exits, agent_log if agent_log.exists() else None))
        stopped = stop.read_records(Path(errors))
    if stopped:  # every rank stopped at the same step; rank 0's record names the checkpoint
        return JobOutcome(stop.exit_code(stopped[0].signum), [], stopped[0], par.world_size)
    return JobOutcome(0, [])

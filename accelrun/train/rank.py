"""One rank of a multi-process job: ``run_rank(RUN_DIR)``, or ``python -m accelrun.train.rank RUN_DIR``.

The elastic agent (``accelrun.dist.launch``) forks each rank into ``run_rank``, which ``train.entry.train``
hands it: dist/ launches what it is given and knows nothing of training. The launcher has already
written ``RUN_DIR/config.yaml`` (the resolved recipe); every rank reads it, joins the process group
(``dist.worker.init_rank``), builds its part of the mesh and trains (``train.run.run_in_dir``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist
from rich.markup import escape
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from accelrun.config import load_config
from accelrun.consoles import DiagnosticConsole
from accelrun.dist import stop
from accelrun.dist.comm_overlap import stop_waiter
from accelrun.dist.context import env_rank
from accelrun.dist.node_configs import check_nodes_agree
from accelrun.dist.rank_errors import leave_record
from accelrun.dist.rank_failures import leave_crash, start_rank_log
from accelrun.dist.worker import init_rank
from accelrun.errors import UserError
from accelrun.train.oom import oom_is_the_recipes
from accelrun.train.run import run_in_dir
from accelrun.train.traced_errors import named_model_errors


def run_rank(run_dir: str, errors_dir: str | None = None) -> None:
    """The agent's entry point for a rank; exits with the rank's code (2: a user error) unless 0.
    A user error is also recorded in ``errors_dir`` for the launcher (``rank_errors``)."""
    folder = Path(errors_dir) if errors_dir else None
    with stop.catch_signals(watch=folder):  # first: the fork server left SIGTERM ignored (dist.fork_server)
        code = main([run_dir], errors_dir=folder)
    # Done: the rank only waits for the agent to collect it. A late Ctrl-C must not turn that into a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if stop.launcher_gone():  # no agent will collect it: torch's wrapper would wait for one for ever
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


def rank_console() -> DiagnosticConsole:
    """A rank's stderr, as one process's (cli/common.py): each line whole, however long, in the terminal
    and in the rank's log (a new user found them broken at 80 columns under two processes)."""
    return DiagnosticConsole(highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None, errors_dir: Path | None = None) -> int:
    run_dir = Path((argv or sys.argv[1:])[0])
    console = rank_console()
    rank, _, local_rank = env_rank()
    log = None
    with contextlib.suppress(OSError):  # no log (a read-only run folder) is no reason to fail here
        log = start_rank_log(run_dir, errors_dir, rank, local_rank)
    try:
        resolved = load_config(run_dir / "config.yaml", search_dirs=[])
        ctx = init_rank(resolved, run_dir)
        check_nodes_agree(run_dir)
        # Worded the same on every rank: the launcher shows a message no rank printed once, not per rank.
        with (oom_is_the_recipes(resolved.config, ctx.device, "in training"),
              named_model_errors(resolved.config.compile.backend, resolved.config.compile.fullgraph)):
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
        stop_waiter()  # its background Work.wait must not outlive the group
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

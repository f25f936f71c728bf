"""Starting multi-process jobs from tests, cheaply.

Most of a job's time on a small machine is Python and torch starting in every process, not the
steps. So jobs are started from the test process itself (``train()`` hands them to torchrun's
elastic agent, exactly as ``accelrun train`` does) instead of through a fresh ``accelrun`` CLI
process, and their ranks are then forked from the one fork server this process starts at its first
launch (accelrun.dist.launch), which imported torch and accelrun once for the whole session. The CLI
is started as a process only where a test is about the CLI or must signal the agent from outside
(the fault tests); its ranks come from that process's own fork server. A job started from here
writes its ranks' output wherever the fork server's stderr went when it started (pytest's capture),
so tests that read a rank's message use the CLI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from accelrun.config import load_config
from accelrun.report.metrics import read_metrics
from accelrun.train.entry import train
from accelrun.train.run import TrainResult
from tests.conftest import DEFAULT_CONFIG, REPO, TINY

LOSS_RTOL = 1e-5  # fp32: sharded reductions sum in a different order than one process does
FSDP2 = ["parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.micro_batch=2"]
# The agent registers handlers for these in the process that runs it; the test process gets its own back.
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def tiny_overrides(runs: Path, steps: int, *more: str) -> list[str]:
    return [*TINY, f"train.steps={steps}", f"report.runs_dir={runs}", *more]


def train_job(runs: Path, steps: int, *overrides: str) -> TrainResult:
    """Train a tiny recipe from this process: inline for one process, through the elastic agent for more."""
    handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
    try:
        return train(load_config(DEFAULT_CONFIG, tiny_overrides(runs, steps, *overrides)), command="test")
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def jobs_once(runs: Path, steps: int, overrides_of: dict[str, list[str]], *extra: str) -> Callable[[str], Path]:
    """``get(name)``: the run directory of job ``name`` (overrides ``overrides_of[name]``), trained the first
    time it is asked for and reused after (a module-scoped fixture returns it)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train_job(runs, steps, *extra, f"name={name}", *overrides_of[name]).run_dir
        return done[name]

    return get


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]


def run_dir_of(runs: Path, name: str) -> Path:
    (d,) = list((runs / name).iterdir())
    return d


def start_cli(*args: str) -> subprocess.Popen:
    """``accelrun train configs/llama.yaml ARGS`` as its own process (stdout and stderr together)."""
    env = {**os.environ, "ACCELRUN_NO_PEAK_PROBE": "1"}
    return subprocess.Popen([sys.executable, "-m", "accelrun.cli.main", "train", str(DEFAULT_CONFIG), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def ranks_of(job_pid: int) -> list[int]:
    """The rank processes of the job that ``accelrun train`` (process ``job_pid``) runs: children of
    its multiprocessing fork server (accelrun.dist.launch), in the order they were forked (rank 0 first)."""
    for pid in children(job_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmdline:
            return children(pid)
    return []


def wait_for_ranks(job: subprocess.Popen, count: int, timeout: float = 240) -> list[int]:
    """``ranks_of(job)`` once ``count`` ranks are there (forked during setup, before the first step): a
    test that signals a rank at a given step looks them up before, not between the step and the signal
    (on a busy machine the job's last steps could pass in between)."""
    deadline = time.time() + timeout
    while time.time() < deadline and job.poll() is None:
        if len(found := ranks_of(job.pid)) >= count:
            return found
        time.sleep(0.02)
    return ranks_of(job.pid)


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def kill_all(pids: list[int]) -> None:
    """SIGKILL those of ``pids`` that are still running."""
    for pid in pids:
        if not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def stop(job: subprocess.Popen) -> None:
    if job.poll() is None:
        job.kill()
        job.wait()


def stop_group(job: subprocess.Popen) -> None:
    """SIGKILL a job started in its own session (launcher, agent and ranks), if it is still running."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()

"""Stopping a run on a signal without losing work: SIGTERM (a scheduler's preemption, ``scancel``,
SLURM's ``--signal``) and SIGINT (Ctrl-C).

A signal never ends a rank mid-step. Each process records the first one it gets; at the loop's next
host read (after every step on a CPU, every ``report.read_every`` steps on a GPU: ``train.step_reads``)
the ranks agree on it (a collective, ``train.loop``), save one checkpoint together and
return; the job then exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), which
tells a scheduler "terminated, may requeue".

Who receives the signal varies, and each case ends the same way:

- the whole process group (SLURM, ``scancel``, Ctrl-C in a terminal): every rank saw it;
- the launcher alone (``kill PID``): it writes a stop request into the job's folder, which every rank
  of its node reads at each host read (``watch``);
- some ranks alone: the collective tells the others;
- the launcher killed (``kill -9``): its ranks, which read its process id from the environment, see it
  gone at the next host read and stop as on SIGTERM (``launcher_gone``).

The ranks return normally (exit 0 to the elastic agent, which would otherwise restart the group) and
leave a record in the job's folder; the launcher turns the records into the exit code and one line.
The agent is told to leave SIGTERM and SIGINT alone (``dist.launch``); left to itself it would kill
the ranks after a grace period, or wait for them to exit without ever collecting them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REQUEST_FILE = "stop-request"
STOP_LEAD_ENV = "ACCELRUN_STOP_LEAD_S"
STATUS = {signal.SIGTERM: "preempted", signal.SIGINT: "interrupted"}

_received = 0  # the first stop signal this process got (0: none)
_received_at = 0.0  # when (time.monotonic())
_depth = 0  # nesting of catch_signals in this process
_forward_to: Path | None = None  # the launcher's job folder: a signal becomes a stop request there
_watch: Path | None = None  # a rank's job folder: a stop request there counts as a signal
_abort: Callable[[], None] | None = None  # the launcher's way out on a second Ctrl-C, while the agent runs
_stopped_at_once = False  # a second Ctrl-C stopped this process where it was (one-process runs)
_runs_entered = 0  # catch_signals entered in this process: whether a SIGTERM outside one came before or after


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


# A second signal this soon after the first is the same one delivered twice, not a user's second
# Ctrl-C: GNU `timeout -s INT` signals its child, then its own process group with the child in it, and
# a 2-rank run killed its ranks without saving (steps lost, a new user's trial). A person's fastest
# double press takes 100 ms or more.
SAME_SIGNAL_WITHIN_S = 0.05


def _handle(signum: int, frame) -> None:
    global _received, _received_at, _stopped_at_once
    if _received and signum == _received and time.monotonic() - _received_at < SAME_SIGNAL_WITHIN_S:
        return
    if _received:
        # The first signal decides; a second one (SLURM's again) changes nothing, except a second
        # Ctrl-C: the user does not want to wait (for the step, the checkpoint, a stuck rank). The
        # launcher aborts the job; a one-process run stops where it is, saving nothing (a checkpoint is
        # renamed into place only once complete, so a half-written one is never resumed from).
        if signum == signal.SIGINT:
            if _abort is not None:
                _abort()
            elif _watch is None:  # not a rank, whose launcher decides (and kills it)
                _stopped_at_once = True
                raise KeyboardInterrupt
        return
    _received, _received_at = signum, time.monotonic()
    if _forward_to is not None:
        _write_request(_forward_to, signum)
    if signum == signal.SIGINT and _watch is None:  # a person's Ctrl-C (not a rank's copy of it): answered now,
        # not after a compile and a step that may take minutes (a trial's first Ctrl-C looked ignored)
        # os.write, not sys.stderr: a handler that runs inside a write to stderr (a full pipe) may not write
        # through its buffer again ("reentrant call"), which would stop the run without saving
        with contextlib.suppress(Exception):
            os.write(2, b"\nCtrl-C: stopping after the step in progress (Ctrl-C again stops at once, saving "
                        b"nothing)\n")


def _write_request(folder: Path, signum: int) -> None:
    tmp = folder / f".{REQUEST_FILE}.{os.getpid()}"
    with contextlib.suppress(OSError):  # the job may be gone already
        tmp.write_text(str(int(signum)))
        os.replace(tmp, folder / REQUEST_FILE)


@contextlib.contextmanager
def catch_signals(*, forward_to: Path | None = None, watch: Path | None = None) -> Iterator[None]:
    """Record SIGTERM and SIGINT instead of dying of them, while inside. ``forward_to``: a job's
    folder the launcher writes a stop request into; ``watch``: the folder a rank reads one from.

    Nests: the outermost entry forgets an earlier run's signal; inner ones add their folders.
    Outside the main thread signals cannot be caught, and this does nothing.
    """
    global _received, _depth, _forward_to, _watch, _stopped_at_once
    old_forward, old_watch = _forward_to, _watch
    old_handlers = {}
    try:
        for s in STOP_SIGNALS:
            old_handlers[s] = signal.signal(s, _handle)
    except ValueError:  # not the main thread
        for s, h in old_handlers.items():
            signal.signal(s, h)
        yield
        return
    global _runs_entered
    if _depth == 0:
        _received, _stopped_at_once = 0, False
    _depth += 1
    _runs_entered += 1
    _forward_to = forward_to or _forward_to
    _watch = watch or _watch
    if _received and forward_to is not None:  # signalled before there was a job to tell
        _write_request(forward_to, _received)
    try:
        yield
    finally:
        _depth -= 1
        _forward_to, _watch = old_forward, old_watch
        for s, h in old_handlers.items():
            signal.signal(s, h)


_trains = True  # the command trains (train, launch): its message says where it was, before or after the steps


def say_stop_outside_runs(command: str) -> None:
    """SIGTERM outside ``catch_signals`` (the command's imports, the recipe's checks, its report after the
    run): there is no step to finish or save, and the process dies of it as before, with its code 143,
    but says so; killed silently in its first seconds, a job looked as if it had never started. A
    ``command`` that trains no run of its own (``ab``, whose variants are processes of their own) says
    only that it stopped."""
    global _trains
    _trains = command in ("train", "launch")
    signal.signal(signal.SIGTERM, _stopped_outside_runs)


def _stopped_outside_runs(signum: int, frame) -> None:
    when = (" after the run's last step: nothing to save" if _runs_entered else " before any step ran: nothing to save"
            ) if _trains else ": nothing of its own to save"
    with contextlib.suppress(Exception):  # a buffer the interrupted code was writing to
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write(f"accelrun: stopped by {signal_name(signum)}{when} (exit {exit_code(signum)})\n")
        sys.stderr.flush()
    os._exit(exit_code(signum))


def late_warning(env: dict[str, str] | None = None) -> str | None:
    """A warning when stopping took longer than the scheduler's lead (``ACCELRUN_STOP_LEAD_S``, which
    the sbatch script of ``accelrun slurm`` sets to its ``--signal=TERM@`` seconds)."""
    lead = (env if env is not None else os.environ).get(STOP_LEAD_ENV)
    if not _received or not lead:
        return None
    took = time.monotonic() - _received_at
    if took <= float(lead):
        return None
    return (f"warning: stopping took {took:.0f} s, more than the {float(lead):g} s the scheduler gives "
            f"({STOP_LEAD_ENV}, #SBATCH --signal=TERM@...): raise it, or the next stop may lose the step")


@contextlib.contextmanager
def abort_on_second_interrupt(abort: Callable[[], None]) -> Iterator[None]:
    """While inside, a second SIGINT calls ``abort`` (in the main thread, from the signal handler)."""
    global _abort
    old, _abort = _abort, abort
    try:
        yield
    finally:
        _abort = old


def stopped_at_once() -> bool:
    """Whether a second Ctrl-C stopped this process where it was, saving nothing (``_handle``)."""
    return _stopped_at_once


def requested() -> int:
    """The stop signal this process got, or the one its launcher asked for, or SIGTERM where its launcher
    is gone (0: none)."""
    if _received or _watch is None:
        return _received
    try:
        return int((_watch / REQUEST_FILE).read_text())
    except (OSError, ValueError):
        pass
    return int(signal.SIGTERM) if launcher_gone() else 0


# Who launched this process's ranks: "pid:start:token" (the launcher's process id, its start time in
# clock ticks since boot, a random token), set by the launcher before its fork server starts, so that
# its ranks inherit it. The start time tells the launcher apart from a later process given its number.
LAUNCHER_ENV = "ACCELRUN_LAUNCHER"


def set_launcher_identity() -> str:
    """This process as its ranks' launcher (once: a second launch in the process keeps the first)."""
    if not os.environ.get(LAUNCHER_ENV, "").startswith(f"{os.getpid()}:"):
        os.environ[LAUNCHER_ENV] = f"{os.getpid()}:{_start_ticks(os.getpid()) or 0}:{uuid.uuid4().hex[:12]}"
    return os.environ[LAUNCHER_ENV]


def launcher_token() -> str | None:
    """The launcher's random token, or None outside a launched rank."""
    parts = os.environ.get(LAUNCHER_ENV, "").split(":")
    return parts[2] if len(parts) == 3 else None


def launcher_gone() -> bool:
    """Whether this rank's launcher has exited (a kill -9 of ``accelrun train``). Its ranks, children of the
    fork server, then trained on unsupervised: to the end, racing a rerun that resumed the same run, and
    then waited for ever for an agent to collect them. They stop as on a SIGTERM instead, with a checkpoint."""
    parts = os.environ.get(LAUNCHER_ENV, "").split(":")
    try:
        pid, started = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a process of another user has the number now: ours is gone
        return True
    stat = _proc_stat(pid)  # a zombie, or another process given the number since
    return stat is not None and (stat[0] in ("Z", "X") or (bool(started) and int(stat[19]) != started))


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot, or None."""
    stat = _proc_stat(pid)
    return int(stat[19]) if stat is not None else None


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the process's name (state first, start time 20th), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


@dataclass(frozen=True)
class Stopped:
    """Where a rank stopped on a signal."""

    rank: int
    signum: int
    step: int  # -1: aborted (a second Ctrl-C) before the ranks agreed on a step
    checkpoint: str | None  # the checkpoint of ``step`` (None: checkpoints are off, or aborted)

    @property
    def status(self) -> str:
        return STATUS.get(signal.Signals(self.signum), "preempted")

    @property
    def aborted(self) -> bool:
        return self.step < 0

    def line(self, ranks: int = 1) -> str:
        """What the user reads: what stopped the run, where, and what to do next."""
        if self.aborted:
            return (f"aborted by a second {signal_name(self.signum)}: the ranks were killed without saving; "
                    f"the same command resumes from the newest complete checkpoint (exit {exit_code(self.signum)})")
        who = f"all {ranks} ranks" if ranks > 1 else "the run"
        saved = (f"{who} saved {self.checkpoint}; the same command resumes from it"
                 if self.checkpoint else "no checkpoint saved (checkpoint.enabled = false)")
        return (f"{self.status} by {signal_name(self.signum)} after step {self.step}: {saved} "
                f"(exit {exit_code(self.signum)})")


def leave_record(folder: Path, stopped: Stopped) -> None:
    tmp = folder / f".stopped-{stopped.rank}.json.tmp"
    tmp.write_text(json.dumps(stopped.__dict__))
    os.replace(tmp, folder / f"stopped-{stopped.rank}.json")


def read_records(folder: Path) -> list[Stopped]:
    """The ranks' stop records, in rank order."""
    out = []
    for path in folder.glob("stopped-*.json"):
        try:
            out.append(Stopped(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=lambda r: r.rank)

"""A failed job explained in one screen: which rank failed first, on which node, how (a signal or an
exit code), its last log lines and where its log is.

The elastic agent reports only the first failure it notices, and after a rank is killed that is
usually another rank, whose collective lost its peer a moment later. So each rank leaves what it knows
in the job's folder: who it is when it starts (rank, node, pid, log file), and the error when it
fails. The launcher adds every rank's exit status, read from the agent after the job, and blames the
rank that ended without an error of its own (killed by a signal, or crashed in native code) before
one whose error says a peer was gone.

Each rank's output is also written to ``<run dir>/logs/rank-<r>.log``; the agent's own log goes to
``<run dir>/logs/agent.log`` instead of the terminal.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

LOGS = "logs"
TAIL_LINES = 8
# What a rank's collective says when another rank went away first: the consequence, not the cause.
PEER_GONE = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out",
             "connection refused", "socket closed", "peer", "waited more than parallel.timeout_s")


def log_path(run_dir: Path, rank: int) -> Path:
    return run_dir / LOGS / f"rank-{rank}.log"


class _Tee(io.TextIOBase):
    """A text stream that writes to the terminal's stream and to a log file."""

    def __init__(self, stream, log) -> None:
        self._stream, self._log = stream, log

    def write(self, s: str) -> int:
        self._log.write(s)
        self._log.flush()
        return self._stream.write(s)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")


def attempt() -> int:
    """Which start of the group this rank belongs to: 0, then 1 after the agent's first restart, ...
    A rank's record says it, so a restarted group's failure is never blamed on the group before it."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def start_rank_log(run_dir: Path, folder: Path | None, rank: int, local_rank: int):
    """Tee this rank's Python output into its log file and record who it is; returns the open log."""
    path = log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - open for the rank's life
    log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} (local {local_rank}) started on "
              f"{socket.gethostname()}, pid {os.getpid()}\n")
    sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    if folder is not None:
        _write(folder / f"proc-{rank}.json", {"rank": rank, "local_rank": local_rank, "pid": os.getpid(),
                                              "host": socket.gethostname(), "log": str(path), "attempt": attempt()})
    return log


def leave_crash(folder: Path | None, log, rank: int, e: BaseException) -> None:
    """An unexpected error of a rank: its traceback to the rank's log only, one line to the launcher."""
    text = "".join(traceback.format_exception(e))
    if log is not None:
        log.write(text)
        log.flush()
    else:
        sys.__stderr__.write(text)
    if folder is not None:
        _write(folder / f"crash-{rank}.json", {"rank": rank, "error": error_line(e), "pid": os.getpid()})


def error_line(e: BaseException) -> str:
    """One short line: the type and the message's last line, less a C++ source location in front and
    the advice after the first sentence (gloo's "[.../pair.cc:537] Read error ...: Connection reset by
    peer. This is typically caused by ...")."""
    text = str(e).strip()
    last = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[-1] if text else "")
    last = last.split(". ")[0][:200]
    return f"{type(e).__name__}: {last}" if last else type(e).__name__


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _read(folder: Path, pattern: str) -> dict[int, dict]:
    out = {}
    for p in folder.glob(pattern):
        try:
            r = json.loads(p.read_text())
            out[int(r["rank"])] = r
        except (OSError, ValueError, KeyError):
            continue
    return out


def latest_start_procs(folder: Path, newer_than: int = -1) -> dict[int, dict]:
    """The process records (by rank) of the group's latest start: the newest any rank recorded, or
    ``newer_than`` where that is newer (a start whose ranks left other records but no process's)."""
    procs = _read(folder, "proc-*.json")
    latest = max([newer_than, *(p.get("attempt", 0) for p in procs.values())])
    return {rank: p for rank, p in procs.items() if p.get("attempt", 0) == latest}


def exit_codes_of(error: BaseException) -> dict[int, int]:
    """Each local rank's exit status (negative: killed by that signal), read from the elastic agent
    that raised ``error`` (``torch_private.agent_exit_codes``). Empty if no frame holds one."""
    from accelrun.torch_private import agent_exit_codes  # torch's: the launcher has it loaded by now

    tb = error.__traceback__
    while tb is not None:
        if (agent := tb.tb_frame.f_locals.get("agent")) is not None and (codes := agent_exit_codes(agent)):
            return codes
        tb = tb.tb_next
    return {}


@dataclass(frozen=True)
class RankEnd:
    rank: int
    host: str
    pid: int | None
    log: str | None
    exit_code: int | None  # negative: the signal
    error: str | None  # its own error line, if it had one

    @property
    def how(self) -> str:
        if self.exit_code is not None and self.exit_code < 0:
            sig = signal.Signals(-self.exit_code).name
            why = " (kill -9, or the kernel's out-of-memory killer)" if sig == "SIGKILL" else ""
            return f"was killed by {sig}{why}"
        code = f"exited with code {self.exit_code}" if self.exit_code is not None else "failed"
        return f"{code}: {self.error}" if self.error else f"{code} without an error of its own"

    @property
    def described(self) -> str:
        return f"rank {self.rank} on node {self.host} (pid {self.pid}) {self.how}"

    @property
    def secondary(self) -> bool:
        """Its error says another rank went away first."""
        return self.error is not None and any(w in self.error.lower() for w in PEER_GONE)


def rank_ends(folder: Path, exit_codes: dict[int, int]) -> list[RankEnd]:
    """How each rank of the group's latest start ended. A record of an earlier start that a restarted
    group's rank has not written over (it failed before its first record) is that start's: left out, as
    is an error of another process of the same rank (a start after another node rejoined keeps the
    restart count)."""
    procs, crashes = latest_start_procs(folder), _read(folder, "crash-*.json")
    users = _read(folder, "rank-*.json")  # rank_errors' records of user errors
    ends = []
    for rank, p in sorted(procs.items()):
        same = [r for r in (crashes.get(rank), users.get(rank)) if r and r.get("pid") == p["pid"]]  # this process's
        error = next((r["error"] for r in same if "error" in r), None) or \
            "; ".join(m for r in same for m in r.get("messages", [])) or None
        ends.append(RankEnd(rank, p["host"], p["pid"], p["log"], exit_codes.get(p["local_rank"]), error))
    return ends


def culprit(ends: list[RankEnd]) -> RankEnd | None:
    """The rank that failed first: killed or crashed without a word, else one with an error of its own
    that is not about a lost peer, else any that failed."""
    failed = [e for e in ends if e.exit_code not in (0, None) or e.error]
    for ok in (lambda e: e.error is None and e.exit_code not in (0, None),
               lambda e: e.error is not None and not e.secondary,
               lambda e: True):
        found = [e for e in failed if ok(e)]
        if found:
            return found[0]
    return None


def tail(path: str | None, n: int = TAIL_LINES) -> list[str]:
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]


# A collective's timeout as gloo, NCCL's watchdog and accelrun's own waiter word it (not a rendezvous's).
TIMED_OUT = ("timed out waiting", "collective operation timeout", "waited more than parallel.timeout_s")


def _waited_for(first: RankEnd, ends: list[RankEnd]) -> str | None:
    """A rank killed by SIGKILL after another rank's collective timed out: it stopped answering, and the
    agent killed it as it tore the group down. Said so, not as kill -9 or the OOM killer (a trial's rank
    stopped with kill -STOP was reported as killed by SIGKILL "or the kernel's out-of-memory killer")."""
    if first.exit_code != -signal.SIGKILL:
        return None
    waited = [e for e in ends if e is not first and e.error and any(w in e.error.lower() for w in TIMED_OUT)]
    if not waited:
        return None
    return (f"rank {first.rank} on node {first.host} (pid {first.pid}) stopped answering: rank {waited[0].rank}'s "
            "collective timed out waiting for it (parallel.timeout_s), and it was then killed by SIGKILL (the "
            "agent tearing the group down, or kill -9 or the kernel's out-of-memory killer before that); its "
            "last lines say where it was")


def _lost_a_peer(first: RankEnd, ends: list[RankEnd]) -> str | None:
    """Every failure this node saw is a lost peer: the rank that failed first is one whose end this node's
    agent did not see (another node's). It had been blamed on the survivor (a trial killed one of two
    nodes: the other node's healthy rank was named as the failure)."""
    if not first.secondary:
        return None
    unseen = [e for e in ends if e.exit_code is None and e.error is None]
    where = ("; the ranks whose end this node did not see: "
             + ", ".join(f"rank {e.rank} on node {e.host} (pid {e.pid})" for e in unseen[:8])
             + (f" and {len(unseen) - 8} more" if len(unseen) > 8 else "")) if unseen else ""
    return (f"rank {first.rank} on node {first.host} (pid {first.pid}) lost its connection to another rank "
            f"({first.error}): the failure began elsewhere, most likely on another node{where}; their node's "
            "output or logs say why")


def explain(folder: Path, exit_codes: dict[int, int], agent_log: Path | None) -> list[str]:
    """The lines that tell the user what failed; empty if the ranks left nothing to go on."""
    ends = rank_ends(folder, exit_codes)
    first = culprit(ends)
    if first is None:
        return []
    lines = [_waited_for(first, ends) or _lost_a_peer(first, ends) or first.described]
    last = tail(first.log)
    lines.append(f"  its last lines ({first.log}):" if last else f"  its log ({first.log}) is empty")
    lines += [f"  | {line}" for line in last]
    for e in ends:
        if e is not first and (e.error or e.exit_code not in (0, None)):
            then = "then " if e.secondary else ""
            lines.append(f"  {then}rank {e.rank} on node {e.host} {e.how} ({e.log})")
    if agent_log is not None:
        lines.append(f"  torchelastic's log: {agent_log}")
    return lines

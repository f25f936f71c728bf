"""How much of the machine's CPU *other* processes used while a child process ran (Linux).

A speed comparison on a machine that something else is also using measures the neighbour as much as
the settings. ``/proc/stat`` gives the CPU time every process used; ours and the child's (with its
own children) come from ``getrusage``; the difference is everyone else's.

Example::

    meter = OtherCpuMeter()
    subprocess.run(cmd)              # the child must have been waited for
    meter.share()                    # 0.42: others used 42% of all cores' time meanwhile
"""

from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path


def _busy_cpu_s() -> float | None:
    """Seconds of CPU time all processes used since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:9]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # not idle (3) or iowait (4)
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """This process's CPU time plus that of its children that have been waited for."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


# Other processes using more than this share of the machine's CPU while a run or comparison was timed
# earn a warning (ab's runs, and every training run's own loop).
BUSY_WARNING = 0.10


class CpuWindow:
    """The machine's busy CPU time and this process's own (its descendants' with it), from construction on. In a job every rank on
    a node opens one; the node's other processes used ``busy_s() - sum(each rank's own_s())``: the
    ranks' CPU time is the job's, not a neighbour's."""

    def __init__(self) -> None:
        self._busy0 = _busy_cpu_s()
        self._own0 = self._own_now()
        self._t0 = time.perf_counter()

    def _own_now(self) -> float:
        return _tree_cpu_s()

    def busy_s(self) -> float | None:
        busy = _busy_cpu_s()
        return None if busy is None or self._busy0 is None else busy - self._busy0

    def own_s(self) -> float:
        return self._own_now() - self._own0

    def wall_s(self) -> float:
        return time.perf_counter() - self._t0

    def others_share(self) -> float | None:
        """Fraction (0-1) of all cores' time that processes other than this one used so far."""
        return others_share(self.busy_s(), self.own_s(), self.wall_s(), os.cpu_count() or 1)


class OtherCpuMeter(CpuWindow):
    """A window that counts this process's waited-for children as its own: :meth:`share` after the
    child has exited and been waited for."""

    def _own_now(self) -> float:
        return _own_cpu_s()

    def share(self) -> float | None:
        return self.others_share()


def _tree_cpu_s() -> float:
    """This process's CPU time with all its descendants': those waited for (``getrusage``) and those
    still running (``/proc``). A compile's helpers (g++, Inductor's pool of workers, which live until
    the process ends) are the run's own work, not a neighbour's: counted as others, a short Inductor
    run warned that other processes used 39% of the CPU on a quiet machine."""
    return _own_cpu_s() + _live_descendants_cpu_s(os.getpid())


def _live_descendants_cpu_s(root: int) -> float:
    """CPU seconds of ``root``'s running descendants, each with its own waited-for children."""
    children: dict[int, list[int]] = {}
    used: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # the command's name may hold spaces
        except OSError:  # it ended meanwhile
            continue
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        used[pid] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime (clock ticks)
    ticks, frontier = 0, list(children.get(root, []))
    while frontier:
        pid = frontier.pop()
        ticks += used[pid]
        frontier += children.get(pid, [])
    return ticks / os.sysconf("SC_CLK_TCK")


def others_share(busy_s: float | None, job_cpu_s: float, wall_s: float, cores: int) -> float | None:
    """Fraction (0-1) of the node's cores that processes outside the job used over ``wall_s``."""
    if busy_s is None or wall_s <= 0 or cores <= 0:
        return None
    return min(max((busy_s - job_cpu_s) / (wall_s * cores), 0.0), 1.0)


def busy_note(share: float | None, where: str, threads: int | None = None,
              effect: str = "the step times and tokens/s are slower than on a quiet machine; to measure, run "
                            "again when it is quiet") -> str | None:
    """The warning a report and the terminal give when others used a noticeable share, else None.
    ``threads``: the run's, when known (at one already, fewer is no advice); ``effect``: what the load
    did to the figures measured during ``where``, and what to do."""
    if share is None or share <= BUSY_WARNING:
        return None
    fewer = "" if threads == 1 else ("; to train beside them, fewer threads wait less on a shared core "
                                     "(train.threads=1)")  # fmt: skip
    return f"other processes used {share:.0%} of this machine's CPU during {where}: {effect} (top shows who is busy){fewer}"


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota_cores()
    return max(1, min(cores, math.floor(quota)) if quota else cores)


def _cgroup_quota_cores(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)

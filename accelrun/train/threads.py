"""How many threads a CPU run takes: the cores it may use that nobody else is using now.

torch starts one thread per core. Beside a busy process that is one thread too many: OpenMP's threads
wait for each other at every parallel region, and the one sharing its core with the neighbour holds
all of them back (this project's 2-core machine, the default recipe beside one busy 1-thread process:
2 threads 1,348 ms a step, 1 thread 765 ms; 438 ms quiet). So a single CPU process without
``train.threads`` counts the cores it may use (its CPU affinity, the cgroup's quota) and what other
processes used of them over a short look before training (two, where the first saw a neighbour),
and takes the cores left, at least one.

    choice = choose_threads()
    torch.set_num_threads(choice.threads); print(choice.describe())
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from accelrun.report.machine_load import CpuWindow, usable_cores

LOOK_S = 0.3  # how long to watch the machine before choosing
LOOKS = 2  # looks at most: a neighbour must be there in each to take a core away
# A neighbour has to hold most of a core to take it away from us: a core 40% used still runs our
# thread most of the time.
BUSY_CORE_FRACTION = 0.6


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    usable_cores: int
    others_cores: float | None  # cores' worth of CPU other processes used while we looked

    def describe(self) -> str:
        if self.threads == self.usable_cores:
            return f"threads: {self.threads} (the cores this process may use)"
        return (f"threads: {self.threads} of {self.usable_cores} cores: other processes are using "
                f"{self.others_cores:.1f} core(s) (train.threads sets it)")


def threads_for(usable: int, others_cores: float | None) -> int:
    """The cores left once each core a neighbour mostly holds is taken away; at least one."""
    if others_cores is None:
        return usable
    taken = math.floor(others_cores + (1 - BUSY_CORE_FRACTION))
    return max(1, usable - taken)


def choose_threads(look_s: float = LOOK_S, looks: int = LOOKS) -> ThreadChoice:
    """The threads to take after up to ``looks`` looks at the machine: a second look only when the first
    saw a neighbour, and the quieter of the two decides (a burst, another process starting, took one
    core of two for a whole run on an otherwise idle machine: 561 ms a step against 308)."""
    usable = usable_cores()
    others = None
    for _ in range(looks):
        window = CpuWindow()
        time.sleep(look_s)
        share = window.others_share()  # of all the machine's cores: back to cores' worth
        seen = None if share is None else share * (os.cpu_count() or 1)
        others = seen if others is None or seen is None else min(others, seen)
        if threads_for(usable, others) == usable:
            break
    return ThreadChoice(threads_for(usable, others), usable, others)

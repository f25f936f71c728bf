"""Time a rank spends blocked in communication, without the profiler.

What is measured: wall time the process spends inside the two places where eager PyTorch code
waits for a collective to finish, whoever issued it:

- ``Work.wait()`` called from Python: every synchronous ``torch.distributed`` call (the loop's loss
  average and gradient-norm reductions, FSDP2's all-gathers and reduce-scatters, barriers,
  object collectives) and every wait on an asynchronous one (pipeline sends and receives);
- ``wait_tensor`` of functional collectives called from Python: DTensor's redistributions, which
  carry tensor parallelism's all-reduces and all-gathers, forward and backward.

What is not: collectives waited on inside compiled graphs or C++ code, time a collective spends in
the background while the rank computes (overlapped, so not on the critical path of this rank),
and other ranks' waits. A wait includes time spent waiting for slower ranks to arrive (skew,
pipeline bubbles), which is part of what a rank loses to communication.

Only meaningful where waiting blocks the host: CPU devices (gloo). On CUDA a wait makes a stream
wait and returns at once, so the timer is not installed there (see :func:`comm_timer_for`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from accelrun.torch_private import functional_collectives as funcol

LABEL = "communication (blocking, measured on rank 0)"


class CommTimer:
    """Accumulates seconds spent blocked in collectives; ``seconds`` only grows."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.waits = 0

    def add(self, dt: float) -> None:
        self.seconds += dt
        self.waits += 1


_active: CommTimer | None = None


def install_comm_timer() -> CommTimer:
    """Wrap ``Work.wait`` and functional ``wait_tensor`` once per process; returns the timer."""
    global _active
    if _active is not None:
        return _active
    timer = CommTimer()
    work_wait = dist.Work.wait
    wait_tensor = funcol.wait_tensor

    def timed_work_wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return work_wait(self, *args, **kwargs)
        finally:
            timer.add(time.perf_counter() - t0)

    def timed_wait_tensor(tensor):
        if torch.compiler.is_compiling():  # traced into a graph (functional collectives): no host wait to time,
            return wait_tensor(tensor)  # and time.perf_counter would break the graph
        t0 = time.perf_counter()
        try:
            return wait_tensor(tensor)
        finally:
            timer.add(time.perf_counter() - t0)

    dist.Work.wait = timed_work_wait
    funcol.wait_tensor = timed_wait_tensor
    _active = timer
    return timer


def active_timer() -> CommTimer | None:
    return _active


def comm_timer_for(world_size: int, device: torch.device) -> CommTimer | None:
    """A timer for a rank of a multi-process job on CPUs; None alone (nothing to time) or on GPUs."""
    if world_size <= 1 or device.type != "cpu":
        return None
    return install_comm_timer()

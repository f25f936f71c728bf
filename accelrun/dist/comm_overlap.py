"""Exposed communication and overlap per step, for FSDP2's collectives and for compiled graphs' ones.

What is measured, per step, on each CPU rank of a job (gloo runs collectives in its own threads):

- **busy**: the time during which at least one traced collective was in flight: the union of the
  intervals from each collective's issue to its completion (completion as gloo reports it, through
  the work's future; a queued collective counts from its issue);
- **exposed**: the time the training thread was blocked on those collectives: a synchronous call's
  whole duration, or the time spent in the wait of an asynchronous one;
- **overlap fraction** = 1 − exposed / busy: the share of communication hidden behind compute.

Traced collectives: under ``fsdp2``, ``torch.distributed.all_gather_single`` and
``reduce_scatter_single`` (what FSDP2's hooks call); under compiled FSDP, every functional collective
in accelrun's graphs, which :func:`instrument_graph` replaces by calls that issue the same collective
asynchronously through ``torch.distributed`` (to see its completion) and time its wait. Not traced:
the loop's own reductions (the loss average, the gradient norm), the same for both.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx

from accelrun.dist.comm_timing import active_timer

_c10d = torch.ops._c10d_functional
_work_wait = dist.Work.wait  # the untimed wait (accelrun.dist.comm_timing wraps the class's)
# The untraced functions, for compiled graphs' collectives (which time themselves).
# (torch 2.13 names them all_gather_single / reduce_scatter_single; the *_tensor names are aliases.)
_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
_all_gather_into_tensor, _reduce_scatter_tensor, _all_reduce = (
    getattr(dist, _GATHER), getattr(dist, _SCATTER), dist.all_reduce)


@dataclass
class CommTrace:
    intervals: list[list[float]] = field(default_factory=list)  # [issue, done]; done = inf until known
    exposed_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def issued(self) -> list[float]:
        iv = [time.perf_counter(), float("inf")]
        with self.lock:
            self.intervals.append(iv)
        return iv

    def step_metrics(self) -> dict[str, float]:
        """This step's figures (since the last call), then start over."""
        now = time.perf_counter()
        with self.lock:
            ivs, self.intervals = sorted((a, min(b, now)) for a, b in self.intervals), []
            exposed, self.exposed_s = self.exposed_s, 0.0
        busy, end = 0.0, float("-inf")
        for a, b in ivs:
            if b > end:
                busy += b - max(a, end)
                end = b
        busy = max(busy, exposed)
        return {"comm_exposed_s": exposed, "comm_busy_s": busy,
                "comm_overlap": (1.0 - exposed / busy) if busy > 0 else None}  # fmt: skip


_trace: CommTrace | None = None


def active_trace() -> CommTrace | None:
    return _trace


class _Waiter:
    """One background thread that waits on asynchronous works in issue order and notes when each
    completes (gloo works have no future to attach a callback to).

    The thread is stopped when the process exits normally, before the interpreter finalizes: a thread
    still inside ``Work.wait`` then (a busy rank's waiter lags its training thread) would be torn down
    while re-taking the GIL in C++ code, which aborts the process (``terminate called without an active
    exception``) after a run that finished. (A forkserver child ends with ``os._exit``: no finalization,
    no abort, no hook needed.) A work that never completes still holds the thread past the timeout."""

    STOP_TIMEOUT_S = 10.0  # a work that never completes (a peer gone) must not hold the exit up

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="accelrun-comm-waiter", daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            work, iv = item
            try:
                _work_wait(work)
            except Exception:  # the training thread's own wait reports it
                pass
            iv[1] = time.perf_counter()

    def stop(self) -> None:
        """Let the thread finish the works queued so far, then end it."""
        self.queue.put(None)
        self.thread.join(self.STOP_TIMEOUT_S)


_waiter: _Waiter | None = None


def _forget_waiter() -> None:
    global _waiter
    _waiter = None  # a forked child has the object but not its thread


os.register_at_fork(after_in_child=_forget_waiter)


def stop_waiter() -> None:
    """End the waiter thread, after the works queued so far: before the process group is destroyed, so
    that no ``Work.wait`` runs in the background while gloo tears its works down (a rank that finished
    then still aborted at exit, CI 2026-11-27: exit code -6, "terminate called without an active
    exception", in an eager FSDP run)."""
    global _waiter
    if _waiter is not None:
        _waiter.stop()
        _waiter = None


def _finish_when_done(work, iv: list[float]) -> None:
    global _waiter
    if _waiter is None:
        _waiter = _Waiter()
    _waiter.queue.put((work, iv))


def install_comm_trace() -> CommTrace:
    """Trace FSDP2's eager collectives (once per process); compiled graphs report to the same trace."""
    global _trace
    if _trace is not None:
        return _trace
    trace = _trace = CommTrace()

    def traced(fn):
        def call(*args, async_op: bool = False, **kwargs):
            iv = trace.issued()
            timer = active_timer()
            t0, waited = time.perf_counter(), timer.seconds if timer is not None else 0.0
            work = fn(*args, async_op=async_op, **kwargs)
            if async_op and work is not None:
                _finish_when_done(work, iv)
                _TRACKED[id(work)] = work
            else:
                iv[1] = time.perf_counter()
                trace.exposed_s += iv[1] - t0
                if timer is not None:  # blocked for the whole call, of which the timer saw only the wait:
                    # the rest too, or "exposed" read larger than the blocking it is part of (a trial's report)
                    timer.seconds += max(0.0, (iv[1] - t0) - (timer.seconds - waited))
            return work

        return call

    for name in (_GATHER, _SCATTER):
        setattr(dist, name, traced(getattr(dist, name)))
    work_wait = dist.Work.wait  # maybe accelrun.dist.comm_timing's: it counts the same blocking

    def wait(self, *args, **kwargs):
        if _TRACKED.pop(id(self), None) is None:
            return work_wait(self, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            return work_wait(self, *args, **kwargs)
        finally:
            trace.exposed_s += time.perf_counter() - t0

    dist.Work.wait = wait
    return trace


_TRACKED: dict[int, object] = {}  # id(work) → work, for works issued by traced calls, until waited


def comm_trace_for(world_size: int, device: torch.device) -> CommTrace | None:
    if world_size <= 1 or device.type != "cpu":
        return None
    return install_comm_trace()


# -- compiled graphs -------------------------------------------------------------------------------------

_PENDING: dict[int, tuple[object, torch.Tensor]] = {}  # id(result) → (work, result)


class _TracedIssue:
    """Issues a functional collective through torch.distributed (async), so its completion is seen."""

    def __init__(self, op) -> None:
        self.op = op
        self.__name__ = f"traced_{op.overloadpacket.__name__}"

    def __repr__(self) -> str:
        return f"traced({self.op})"

    def __call__(self, *args):
        trace = _trace
        name = self.__name__[len("traced_"):]
        if trace is None:
            return self.op(*args)
        if name == "all_gather_into_tensor":
            inp, size, group = args
            out = inp.new_empty((inp.shape[0] * size, *inp.shape[1:]))
            iv = trace.issued()
            work = _all_gather_into_tensor(out, inp.contiguous(), group=_pg(group), async_op=True)
        elif name == "reduce_scatter_tensor":
            inp, op, size, group = args
            out = inp.new_empty((inp.shape[0] // size, *inp.shape[1:]))
            iv = trace.issued()
            work = _reduce_scatter_tensor(out, inp.contiguous(), op=_op(op), group=_pg(group), async_op=True)
        elif name == "all_reduce":
            inp, op, group = args
            out = inp.clone()
            iv = trace.issued()
            work = _all_reduce(out, op=_op(op), group=_pg(group), async_op=True)
        else:
            return self.op(*args)
        _finish_when_done(work, iv)
        _PENDING[id(out)] = (work, out)
        return out


def traced_wait(tensor: torch.Tensor) -> torch.Tensor:
    pending = _PENDING.pop(id(tensor), None)
    if pending is None:
        return _c10d.wait_tensor.default(tensor)
    t0 = time.perf_counter()
    pending[0].wait()
    if _trace is not None:
        _trace.exposed_s += time.perf_counter() - t0
    return tensor


def _pg(name: str):
    return dist.distributed_c10d._resolve_process_group(name)


def _op(name: str):
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}[name.lower()]  # fmt: skip


def instrument_graph(gm: fx.GraphModule) -> int:
    """Route the graph's collectives through the trace; returns how many were replaced."""
    from accelrun.compile.schedule import WAIT, is_collective, kind

    n_done = 0
    for n in gm.graph.nodes:
        if is_collective(n) and kind(n) in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
            n.target = _TracedIssue(n.target)
            n_done += 1
        elif n.op == "call_function" and n.target is WAIT:
            n.target = traced_wait
    gm.recompile()
    return n_done

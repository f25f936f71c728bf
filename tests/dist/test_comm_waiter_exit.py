"""The comm trace's waiter thread ends before the interpreter finalizes.

A rank's waiter (``accelrun.dist.comm_overlap``) waits on gloo works in a background thread and can lag
the training thread on a busy machine. Left running at exit, a waiter inside ``Work.wait`` is torn
down while re-taking the GIL in C++ code and aborts a rank that finished (exit code -6, "terminate
called without an active exception"). Here a process queues works slower than it exits: every one is
seen completed by the time the last exit hook runs, and the process exits cleanly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, json, sys, threading, time
    from accelrun.dist import comm_overlap

    intervals = []

    def report():  # registered before the waiter exists, so it runs after the waiter's own exit hook
        json.dump({"done": [iv[1] != float("inf") for iv in intervals],
                   "alive": any(t.name == "accelrun-comm-waiter" for t in threading.enumerate())}, open(sys.argv[1], "w"))

    atexit.register(report)

    class SlowWork:  # completes a while after it is issued, as a gloo work still in flight
        def wait(self):
            time.sleep(0.2)

    comm_overlap._work_wait = SlowWork.wait
    for _ in range(3):
        intervals.append([time.perf_counter(), float("inf")])
        comm_overlap._finish_when_done(SlowWork(), intervals[-1])
""")


def test_queued_works_finish_before_the_process_exits(tmp_path):
    out = tmp_path / "seen.json"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(out.read_text())
    assert seen == {"done": [True, True, True], "alive": False}


def test_the_rank_stops_the_waiter_before_it_destroys_its_process_group(monkeypatch):
    """A background Work.wait must not run while gloo tears the group's works down (a finished eager FSDP
    rank aborted at exit, CI 2026-11-27): the rank drains and ends the waiter first."""
    import time

    from accelrun.dist import comm_overlap
    from accelrun.train import rank

    class SlowWork:
        def wait(self):
            time.sleep(0.1)

    monkeypatch.setattr(comm_overlap, "_work_wait", SlowWork.wait)
    intervals = [[time.perf_counter(), float("inf")] for _ in range(3)]
    for iv in intervals:
        comm_overlap._finish_when_done(SlowWork(), iv)
    thread = comm_overlap._waiter.thread
    order = []
    monkeypatch.setattr(rank, "load_config", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop here")))
    monkeypatch.setattr(rank, "leave_crash", lambda *a: order.append(("crash", thread.is_alive())))
    monkeypatch.setattr(rank.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(rank.dist, "destroy_process_group", lambda: order.append(("destroy", thread.is_alive())))
    assert rank.main(["/nonexistent-run"]) == 1
    assert order[-1] == ("destroy", False)  # the waiter had ended when the group went
    assert all(iv[1] != float("inf") for iv in intervals) and comm_overlap._waiter is None

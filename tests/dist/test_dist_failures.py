"""A failed 2-rank job explained in one screen: the rank that failed first is blamed (not the one whose
collective lost it a moment later), with its node, signal, log file and last lines; torchelastic's
own output goes to the run folder's logs/agent.log instead of the terminal."""

from __future__ import annotations

import os
import signal

from accelrun.dist.rank_failures import RankEnd, culprit, error_line
from tests.dist.jobs import FSDP2, kill_all, ranks_of, start_cli, stop, tiny_overrides
from tests.dist.test_dist_stop import wait_for_step


def test_kill_9_of_rank_1_blames_rank_1_in_a_few_lines(tmp_path):
    runs = tmp_path / "runs"
    job = start_cli(*tiny_overrides(runs, 100000, "name=killed", "checkpoint.every=100000"), *FSDP2)
    workers: list[int] = []
    try:
        run_dir = wait_for_step(job, runs, "killed", 2)
        assert run_dir is not None, "the job did not get going"
        workers = ranks_of(job.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        out, _ = job.communicate(timeout=120)
    finally:
        kill_all(workers)
        stop(job)
    assert job.returncode == 1, out[-3000:]
    after = out[out.index("launching"):].splitlines()
    assert len(after) < 25 and "Traceback" not in out, out  # one screen, no torchelastic dump
    flat = " ".join(out.split())
    logs = run_dir / "logs"
    assert f"error: rank 1 on node {os.uname().nodename} (pid {workers[1]}) was killed by SIGKILL" in flat, out
    assert f"its last lines ({logs / 'rank-1.log'}):" in flat, out
    assert f"then rank 0 on node {os.uname().nodename} exited with code 1" in flat, out
    assert f"torchelastic's log: {logs / 'agent.log'}" in flat, out
    # The agent's account of the failure is in its log; rank 0's traceback is in its own.
    assert "failed" in (logs / "agent.log").read_text()
    assert "Traceback" in (logs / "rank-0.log").read_text()


def test_culprit_is_the_rank_without_an_error_of_its_own():
    killed = RankEnd(1, "h", 11, None, -9, None)
    lost_peer = RankEnd(0, "h", 10, None, 1, error_line(RuntimeError("[x.cc:1] Read error: Connection reset by peer. GLHF")))
    assert culprit([lost_peer, killed]) is killed
    own = RankEnd(1, "h", 11, None, 1, "ValueError: bad shard")
    assert culprit([lost_peer, own]) is own
    assert culprit([RankEnd(0, "h", 10, None, 0, None)]) is None
    assert "was killed by SIGKILL (kill -9" in killed.how and lost_peer.secondary and not own.secondary


def test_a_node_whose_ranks_only_lost_a_peer_says_the_failure_began_elsewhere():
    """A trial killed one node of two: the other node's healthy rank, which lost its peer, was named
    as the failure ("rank 1 ... exited with code 1: RuntimeError: ... Connection reset by peer")."""
    from accelrun.dist.rank_failures import _lost_a_peer

    other_node = RankEnd(0, "node-b", 20, None, None, None)  # its agent is on the other node: no end seen here
    survivor = RankEnd(1, "node-a", 11, None, 1, error_line(RuntimeError("Read error: Connection reset by peer")))
    assert culprit([other_node, survivor]) is survivor
    said = _lost_a_peer(survivor, [other_node, survivor])
    assert said.startswith("rank 1 on node node-a (pid 11) lost its connection to another rank (") and \
        "the failure began elsewhere" in said and "rank 0 on node node-b (pid 20)" in said, said
    killed = RankEnd(0, "node-a", 10, None, -9, None)
    assert _lost_a_peer(culprit([killed, survivor]), [killed, survivor]) is None  # a failure seen here is named


def test_a_rank_killed_after_anothers_collective_timed_out_is_said_to_have_stopped_answering():
    """A trial stopped rank 1 (kill -STOP); rank 0's collective timed out and the agent killed rank 1: the
    headline said "killed by SIGKILL (kill -9, or the kernel's out-of-memory killer)"."""
    from accelrun.dist.rank_failures import _waited_for

    killed = RankEnd(1, "h", 11, None, -9, None)
    waited = RankEnd(0, "h", 10, None, 1, "DistBackendError: [gloo] Timed out waiting 20000ms for recv operation")
    said = _waited_for(killed, [waited, killed])
    assert said is not None and said.startswith("rank 1 on node h (pid 11) stopped answering: rank 0's collective "
                                                "timed out waiting for it")
    assert _waited_for(killed, [killed, RankEnd(0, "h", 10, None, 1, "ValueError: bad shard")]) is None
    rendezvous = RankEnd(0, "h", 10, None, 1, "RendezvousTimeoutError: the rendezvous timed out")
    assert _waited_for(killed, [rendezvous, killed]) is None  # not a collective's timeout


def test_a_restarted_group_is_not_blamed_for_its_predecessor_s_errors(tmp_path):
    """After the agent restarts the group, the first start's crash records stay in the folder until a
    rank of the new start writes over them: a failure of the new group named the old group's error.
    Each record says its start; and the launcher's line at the restart names the rank that died."""
    import json

    from accelrun.dist.launch import restart_line
    from accelrun.dist.rank_failures import rank_ends

    def record(name, **fields):
        (tmp_path / name).write_text(json.dumps(fields))

    record("proc-0.json", rank=0, local_rank=0, pid=10, host="h", log="rank-0.log", attempt=0)
    record("proc-1.json", rank=1, local_rank=1, pid=11, host="h", log="rank-1.log", attempt=0)
    record("crash-0.json", rank=0, error="RuntimeError: Connection reset by peer", pid=10)
    line = restart_line(tmp_path, {1: -9}, 1, 3)
    assert line.startswith("rank 1 on node h (pid 11) was killed by SIGKILL (kill -9"), line
    assert "(its log: rank-1.log); restarting the ranks (restart 1 of the 3 --max-restarts allows)" in line
    # the second start's rank 0 has written its record; its predecessor's crash is not its own
    record("proc-0.json", rank=0, local_rank=0, pid=20, host="h", log="rank-0.log", attempt=1)
    ends = {e.rank: e for e in rank_ends(tmp_path, {})}
    assert ends[0].error is None and ends[0].pid == 20
    record("crash-0.json", rank=0, error="ValueError: its own", pid=20)
    assert [(e.rank, e.error) for e in rank_ends(tmp_path, {})] == [(0, "ValueError: its own")]  # rank 1: the old start's
    record("crash-0.json", rank=0, error="ValueError: another process's", pid=21)
    assert rank_ends(tmp_path, {})[0].error is None  # the same start number, another process (a rejoin)
    assert restart_line(tmp_path / "none", {}, 2, 3).startswith("a rank of this node's group failed; restarting")

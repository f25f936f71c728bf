"""A real 2-node job: two network namespaces (own addresses, a veth between them), each running
`accelrun train` for its node, meeting through c10d rendezvous on the first one's address."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from accelrun.report.metrics import read_metrics
from tests.conftest import DEFAULT_CONFIG, REPO, TINY
from tests.dist import netns
from tests.dist.jobs import LOSS_RTOL

WHY_NOT = netns.available()
STEPS = 4


def _two_node_job(job_of_node, rdzv_id: str, port: int) -> list[tuple[subprocess.Popen, str]]:
    """`accelrun train` on each of two network namespaces, node ``n`` with ``job_of_node(n)``'s arguments,
    meeting through c10d rendezvous on the first one's address; each process with its output."""
    with netns.two_hosts() as hosts:
        host_addr = hosts[0][2]
        procs = []
        for node_rank, (ns, iface, addr) in enumerate(hosts):
            env = {**os.environ, "ACCELRUN_NO_PEAK_PROBE": "1", "GLOO_SOCKET_IFNAME": iface}
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "accelrun.cli.main", "train",
                   str(DEFAULT_CONFIG), *job_of_node(node_rank), "--nnodes", "2", "--node-rank", str(node_rank),
                   "--rdzv-endpoint", f"{host_addr}:{port}", "--rdzv-id", rdzv_id, "--local-addr", addr]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=300)[0] for p in procs]
    return list(zip(procs, outs, strict=True))


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")
def test_two_nodes_through_c10d_rendezvous_match_one_process(reference, tmp_path):
    runs = tmp_path / "runs"
    common = [*TINY, f"train.steps={STEPS}", f"report.runs_dir={runs}", "checkpoint.every=2"]

    job = [*common, "name=two-nodes", "parallel.nproc_per_node=1", "parallel.dp_shard=2", "train.micro_batch=2"]
    for p, out in _two_node_job(lambda node: job, "nsjob", 29477):
        assert p.returncode == 0, out[-3000:]

    job_dir = runs / "two-nodes" / "job-nsjob"
    report = json.loads((job_dir / "report.json").read_text())
    assert report["world_size"] == 2
    got = [m["loss"] for m in read_metrics(job_dir / "metrics.jsonl")]
    assert got == pytest.approx(reference(STEPS).losses, rel=LOSS_RTOL)


@pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")
def test_nodes_started_with_different_recipes_stop_with_one_recipe_error(tmp_path):
    """A trial started node 0 with train.steps=20 and node 1 with train.steps=30 and another learning rate:
    the job trained the config.yaml written last, and node 0 printed a normal `done:` for it."""
    runs = tmp_path / "runs"
    job = [*TINY, f"report.runs_dir={runs}", "name=mixed", "parallel.nproc_per_node=1", "parallel.dp_shard=2",
           "train.micro_batch=2"]
    for p, out in _two_node_job(lambda node: [*job, f"train.steps={4 + 2 * node}"], "mixjob", 29478):
        assert p.returncode == 2, out[-3000:]
        said = " ".join(out.split())
        assert "the nodes of this job started from different recipes (training hash " in said, out[-3000:]
        assert "start every node with the same recipe and overrides" in said
    assert not (runs / "mixed" / "job-mixjob" / "metrics.jsonl").exists()

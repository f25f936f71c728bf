"""Launch plumbing that needs no processes: SLURM environment, dry-run commands, sbatch, rendezvous."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.dist.launch import launch_config
from accelrun.dist.launch_options import LaunchOptions
from accelrun.dist.slurm import first_host, launch_from_slurm
from tests.conftest import DEFAULT_CONFIG


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[003-005,009],cpu01", "gpu003"), ("node7", "node7"), ("a-1,a-2", "a-1"), ("x[10,12]", "x10"),
    ("a100-[01-02]-ib", "a100-01-ib"),  # a suffix after the brackets (a trial: read as a100-01)
])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_launch_options_from_slurm_environment():
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[010-013]"}
    nodes, opts = launch_from_slurm(env)
    assert nodes == 4 and opts.node_rank == 2
    assert opts.rdzv_endpoint == "gpu010:29500" and opts.rdzv_id == "slurm4242"
    assert launch_from_slurm({}) is None


def test_rendezvous_config_standalone_and_multi_node():
    par = load_config(DEFAULT_CONFIG, ["parallel.nproc_per_node=2", "train.micro_batch=8"]).config.parallel
    cfg = launch_config(par, LaunchOptions())
    assert cfg.rdzv_backend == "c10d" and cfg.rdzv_endpoint == "localhost:0" and cfg.nproc_per_node == 2
    par = load_config(DEFAULT_CONFIG, ["parallel.nnodes=2", "parallel.nproc_per_node=1",
                                       "train.micro_batch=8"]).config.parallel
    host = launch_config(par, LaunchOptions(node_rank=0, rdzv_endpoint="10.0.0.1:29500", rdzv_id="j"))
    other = launch_config(par, LaunchOptions(node_rank=1, rdzv_endpoint="10.0.0.1:29500", rdzv_id="j"))
    assert (host.min_nodes, host.max_nodes) == (2, 2) and host.rdzv_endpoint == "10.0.0.1:29500"
    assert host.rdzv_configs["is_host"] is True and other.rdzv_configs["is_host"] is False


def test_dry_run_prints_each_node_command():
    r = CliRunner().invoke(cli, ["launch", str(DEFAULT_CONFIG), "parallel.nnodes=2", "parallel.nproc_per_node=2",
                                 "train.micro_batch=4", "--dry-run", "--rdzv-endpoint", "h0:29500"])
    assert r.exit_code == 0, r.output
    assert "--node-rank 0" in r.stdout and "--node-rank 1" in r.stdout and "h0:29500" in r.stdout
    # without --dry-run the same (it was refused, while the help said launch runs nothing: a trial's)
    plain = CliRunner().invoke(cli, ["launch", str(DEFAULT_CONFIG), "parallel.nnodes=2", "parallel.nproc_per_node=2",
                                     "train.micro_batch=4", "--rdzv-endpoint", "h0:29500"])
    assert plain.exit_code == 0 and plain.stdout == r.stdout, plain.output
    # an endpoint train would refuse is refused here too (it printed commands that fail on every node)
    r = CliRunner().invoke(cli, ["launch", str(DEFAULT_CONFIG), "parallel.nnodes=2", "--dry-run",
                                 "--rdzv-endpoint", "h0:abc"])
    assert r.exit_code == 2 and "the port 'abc' is not a number" in r.output, r.output


def test_sbatch_script(tmp_path):
    out = tmp_path / "job.sbatch"
    r = CliRunner().invoke(cli, ["slurm", str(DEFAULT_CONFIG), "parallel.nnodes=2", "parallel.nproc_per_node=8",
                                 "train.micro_batch=1", "--partition", "gpu", "-o", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text and "#SBATCH --partition=gpu" in text
    assert "accelrun train" in text and "parallel.nnodes=2" in text
    # the node's cores to the task, and a failed node stops the others (a cluster engineer's trial)
    assert "#SBATCH --exclusive" in text
    assert 'srun --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 accelrun train' in text


def test_several_nodes_need_a_job_id(tiny):
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(1), "parallel.nproc_per_node=1",
                                 "train.micro_batch=2", "--nnodes", "2"])
    assert r.exit_code == 2 and "--rdzv-id" in r.output


@pytest.mark.parametrize("options, message", [
    # torch's launcher waited two minutes at the rendezvous, then printed C++ frames and a traceback (exit 1)
    (("--nnodes", "2", "--node-rank", "5", "--rdzv-id", "j1", "--rdzv-endpoint", "localhost:29511"),
     "--node-rank 5: a job of 2 node(s) (--nnodes, parallel.nnodes) has node ranks 0 to 1"),
    # a traceback (exit 1) after the run folder was made
    (("--rdzv-endpoint", "nohost:xx"), "--rdzv-endpoint 'nohost:xx': the port 'xx' is not a number from 0 to 65535; "
                                       "expected HOST:PORT, e.g. nohost:29500"),
    (("--rdzv-endpoint", "[::1"), "--rdzv-endpoint '[::1': expected HOST:PORT, with an IPv6 address in brackets"),
    # trained the whole job, then torchelastic divided by zero (exit 1)
    (("--max-restarts", "-1"), "Invalid value for '--max-restarts': -1 is not in the range x>=0"),
])
def test_launch_options_the_launcher_would_fail_on_are_refused_first(tiny, tmp_path, options, message):
    """Found by a new user's trial (2026-12-07): each is one line and exit 2, and no run folder is made."""
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(1), "parallel.nproc_per_node=2",
                                 "train.micro_batch=1", *options])
    assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output
    assert not (tmp_path / "runs").exists()


def test_an_endpoint_torch_takes_is_not_refused():
    from accelrun.dist.launch_options import endpoint_problem

    assert [endpoint_problem(e) for e in ("node0", "node0:29500", "[::1]", "[fe80::1]:29400")] == [None] * 4


def test_a_rendezvous_this_node_cannot_reach_is_one_line(tiny, monkeypatch):
    """What torch's launcher raises there (RendezvousConnectionError after its store's timeout) is said with
    the endpoint and what to check, not as C++ frames and a traceback."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    import accelrun.dist.launch as launch

    def unreachable(config, entry):
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as refused:
            raise RendezvousConnectionError("The connection to the C10d store has failed. See inner exception "
                                            "for details.") from refused

    monkeypatch.setattr(launch, "elastic_launch", unreachable)
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(1), "parallel.nproc_per_node=2", "train.micro_batch=1",
                                 "--nnodes", "2", "--node-rank", "1", "--rdzv-id", "j2",
                                 "--rdzv-endpoint", "localhost:29512"])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert ("this node (--node-rank 1) could not join the job's rendezvous at localhost:29512: "
            "RendezvousConnectionError: The connection to the C10d store has failed. See inner exception for "
            "details. (ConnectionRefusedError: [Errno 111] Connection refused). Node 0 hosts it there") in said, said

import json
import shutil
import subprocess

import pytest
import torch

from accelrun.report.env import collect_env


def test_collect_env_is_json_and_complete(tmp_path):
    env = collect_env(cwd=tmp_path)
    json.dumps(env)
    assert env["versions"]["torch"] == torch.__version__
    assert env["versions"]["accelrun"]
    assert env["cpu"]["model"] and env["cpu"]["logical_cores"] >= 1
    assert env["cpu"]["torch_threads"] == torch.get_num_threads()
    assert env["cuda"]["available"] == torch.cuda.is_available()
    assert env["git"] == {"commit": None, "dirty": None}  # tmp_path is not a git repository


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_collect_env_reads_git_commit(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("x")
    git("add", "f")
    git("commit", "-q", "-m", "one")
    env = collect_env(cwd=tmp_path)
    assert len(env["git"]["commit"]) >= 40 and env["git"]["dirty"] is False
    (tmp_path / "f").write_text("y")
    assert collect_env(cwd=tmp_path)["git"]["dirty"] is True


def test_env_of_a_multi_rank_cpu_job_records_the_ranks_threads():
    import os

    from accelrun.config import load_config
    from accelrun.train.entry import _env_of_ranks
    from tests.conftest import DEFAULT_CONFIG

    cfg = load_config(str(DEFAULT_CONFIG), ["parallel.nproc_per_node=2", "train.micro_batch=8", "train.device=cpu"]).config
    assert _env_of_ranks(cfg)["cpu"]["torch_threads"] == max(1, (os.cpu_count() or 1) // 2)
    pinned = load_config(str(DEFAULT_CONFIG), ["parallel.nproc_per_node=2", "train.micro_batch=8", "train.threads=1"]).config
    assert _env_of_ranks(pinned)["cpu"]["torch_threads"] == torch.get_num_threads()  # set by train() itself

"""What a job of CUDA ranks checks and sets before it trains, tested on this CPU by pretending
torch sees GPUs: one GPU per process, NCCL's flight recorder in the run directory, and the memory
figures each step reports (its own peak, and the allocator's reserve)."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import ConfigError, load_config
from accelrun.dist import worker
from accelrun.report import memory
from accelrun.train.entry import train
from tests.conftest import DEFAULT_CONFIG


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_more_processes_than_gpus_is_a_user_error_before_launch(tiny, monkeypatch, tmp_path):
    _gpus(monkeypatch, 1)
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(2), "parallel.nproc_per_node=2",
                                 "parallel.dp_shard=2", "train.micro_batch=2", "train.device=cuda"])
    assert r.exit_code == 2, r.output
    assert "parallel.nproc_per_node = 2, but this node has 1 CUDA device(s)" in r.output, r.output
    assert "launching" not in r.output and not (tmp_path / "runs").exists()


def test_enough_gpus_or_cpu_ranks_pass_the_check(tiny, monkeypatch):
    cfg = load_config(DEFAULT_CONFIG, [*tiny(2), "parallel.nproc_per_node=2", "parallel.dp_shard=2",
                                       "train.micro_batch=2", "train.device=auto"]).config
    _gpus(monkeypatch, 2)
    worker.check_devices(cfg)
    _gpus(monkeypatch, 1)
    cpu = load_config(DEFAULT_CONFIG, [*tiny(2), "parallel.nproc_per_node=2", "parallel.dp_shard=2", "train.micro_batch=2",
                                       "train.device=cpu"]).config
    worker.check_devices(cpu)  # CPU ranks need no GPU
    try:
        worker.check_devices(cfg)
    except ConfigError as e:
        assert "train.device = cpu" in str(e)
    else:
        raise AssertionError("2 processes on 1 GPU passed the check")


def test_nccl_flight_recorder_dumps_into_the_run_directory(monkeypatch, tmp_path):
    for k in (*worker.NCCL_FLIGHT_RECORDER, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(k, raising=False)
    env = worker.nccl_environment(tmp_path)
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_flight_recorder" / "rank_")
    # What the user set wins.
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "7")
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in worker.nccl_environment(tmp_path)


def test_cuda_reserved_memory_is_the_allocators_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 4096)
    assert memory.peak_reserved_bytes(torch.device("cuda", 0)) == 4096
    assert memory.peak_reserved_bytes(torch.device("cpu")) is None


def test_each_step_starts_a_new_memory_peak(tiny, monkeypatch):
    import accelrun.train.loop as loop

    resets = []
    monkeypatch.setattr(loop, "reset_peak_memory", lambda dev: resets.append(dev))
    r = train(load_config(DEFAULT_CONFIG, tiny(3)), command="test")
    assert r.status == "finished" and resets == [torch.device("cpu")] * 3

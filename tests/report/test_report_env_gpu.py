"""env.json on a GPU host: driver, CUDA and NCCL versions, each device's compute capability and memory,
and every NCCL variable (tested here with torch's CUDA queries pretended)."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import torch

from accelrun.report import env as env_mod


def test_cuda_host_records_devices_versions_and_nccl_variables(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_520_809_984))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setattr(subprocess, "run", _fake_nvidia_smi(subprocess.run))
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    env = env_mod.collect_env(cwd=tmp_path)
    json.dumps(env)
    cuda = env["cuda"]
    assert cuda["device_details"] == [{"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
                                       "memory_gib": 79.65}] * 2
    assert cuda["nccl_version"] == "2.21.5" and cuda["driver_version"] == "550.54.15"
    assert env["env_vars"]["NCCL_IB_DISABLE"] == "1" and env["env_vars"]["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"


def test_cpu_host_has_no_gpu_details(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda = env_mod.collect_env(cwd=tmp_path)["cuda"]
    assert cuda["available"] is False and "device_details" not in cuda


def _fake_nvidia_smi(real):
    def run(cmd, *args, **kwargs):
        if cmd and cmd[0] == "nvidia-smi":
            return subprocess.CompletedProcess(cmd, 0, stdout="550.54.15\n550.54.15\n", stderr="")
        return real(cmd, *args, **kwargs)

    return run

"""What machine and software a run ran on, for ``env.json`` and the report.

Everything here is plain JSON (str, int, bool, None, lists, dicts). Probes that can fail (git, CUDA
queries, an optional package) give None rather than stopping a run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
from pathlib import Path

import accelrun
from accelrun.report.peak import cpu_model_name

# Environment variables that change how fast or where a run goes; values are recorded as set.
RECORDED_ENV_VARS = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "TORCH_COMPILE_DEBUG", "TRITON_INTERPRET", "ACCELRUN_CACHE_DIR", "ACCELRUN_NO_PEAK_PROBE",
)
# And every variable of NCCL and of torch's NCCL process group (timeouts, flight recorder, transports).
RECORDED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
GIT_TIMEOUT_S = 5.0


def collect_env(cwd: str | Path | None = None) -> dict:
    """Versions, platform, CPU and GPU description, and the git commit of ``cwd`` (default: the cwd).

    Example::

        write_json(collect_env(), run_dir / "env.json")
    """
    import torch

    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _triton_version(),
            "accelrun": accelrun.__version__,
        },
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": {
            "model": cpu_model_name(),
            "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
        },
        "cuda": _cuda_info(),
        "git": _git_info(Path(cwd) if cwd is not None else Path.cwd()),
        "env_vars": {k: v for k, v in sorted(os.environ.items())
                     if k in RECORDED_ENV_VARS or k.startswith(RECORDED_ENV_PREFIXES)},
    }


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import triton
    except Exception:  # a broken install is "not importable"
        return None
    return str(getattr(triton, "__version__", "unknown"))


def _cuda_info() -> dict:
    import torch

    available = torch.cuda.is_available()
    info: dict = {
        "available": available,
        "device_count": torch.cuda.device_count() if available else 0,
        "devices": [],
        "cuda_version": torch.version.cuda,
        "hip_version": getattr(torch.version, "hip", None),
        "cudnn_version": None,
    }
    if available:
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
        try:
            info["cudnn_version"] = torch.backends.cudnn.version()
        except Exception:  # cuDNN missing or failing to load: record it as unknown
            info["cudnn_version"] = None
        info["device_details"] = [_cuda_device(i) for i in range(info["device_count"])]
        info["nccl_version"] = _nccl_version()
        info["driver_version"] = _nvidia_driver_version()
    return info


def _cuda_device(index: int) -> dict:
    import torch

    try:
        props = torch.cuda.get_device_properties(index)
        major, minor = torch.cuda.get_device_capability(index)
    except Exception:  # a device that cannot be queried is recorded as unknown
        return {"name": None, "compute_capability": None, "memory_gib": None}
    return {"name": props.name, "compute_capability": f"{major}.{minor}",
            "memory_gib": round(props.total_memory / 2**30, 2)}


def _nccl_version() -> str | None:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception:  # torch built without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _nvidia_driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def _git(cwd: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _git_info(cwd: Path) -> dict:
    commit = _git(cwd, "rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    status = _git(cwd, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}

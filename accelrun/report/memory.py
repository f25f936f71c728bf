"""Current and peak memory of one device, measured the way that device allows.

CUDA: bytes the caching allocator handed to tensors (``memory_allocated`` / ``max_memory_allocated``),
with a peak that can be reset between phases. CPU: the whole process's resident set size; its peak
(``ru_maxrss``) covers the process's whole life and cannot be reset, so it includes everything the
process held before training started.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes since the last reset (CUDA) or since the process started (CPU peak RSS)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "cpu":
        return _peak_rss_bytes()
    return None


def peak_reserved_bytes(device: torch.device) -> int | None:
    """Peak bytes the CUDA caching allocator held (tensors, its cache and fragmentation) since the
    last reset; None elsewhere. What an out-of-memory error compares with the device's memory."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def current_memory_bytes(device: torch.device) -> int | None:
    """Bytes held now: allocated tensors (CUDA) or the process's resident set size (CPU)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        return _current_rss_bytes()
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak on CUDA; a no-op on a CPU, where the process peak cannot be reset."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def describe_memory(device: torch.device) -> str:
    """What :func:`peak_memory_bytes` measures on this device, for reports."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return ("CUDA max_memory_allocated per step (reset as each step starts; tensors only, the allocator's "
                "reserve is mem_reserved_bytes)")
    if device.type == "cpu":
        return "process peak RSS (ru_maxrss: the whole process since it started)"
    return f"not measured on {device.type}"


def _peak_rss_bytes() -> int:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def _current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")

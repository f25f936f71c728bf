"""Running out of memory, told as a problem of the recipe: what could not be allocated, what the
device has, what the planner expects this recipe to need and which keys lower it (exit 2)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from accelrun.errors import UserError

GIB = 1024**3
_TRIED = re.compile(r"tried to allocate (\d+(?:\.\d+)?)\s*(bytes|[KMG]iB)", re.IGNORECASE)
_UNITS = {"bytes": 1, "kib": 1024, "mib": 1024**2, "gib": GIB}


class OutOfMemory(UserError):
    """An allocation failed: the recipe needs more memory than the device has."""


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def device_memory_gib(device: torch.device, nproc_per_node: int) -> float | None:
    """What one process may use: the GPU's memory, or the host's RAM shared by its CPU ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024 / GIB / max(1, nproc_per_node)


def planner_estimate(cfg, capacity_gib: float | None) -> str | None:
    """The planner's peak for this recipe on one device, with its largest term; None if it cannot say."""
    try:
        from accelrun.plan.memory import estimate_memory
        from accelrun.plan.workload import workload_from_config

        cluster = SimpleNamespace(reserved_gib=0.0, memory_gib=capacity_gib or 0.0)  # tensors only
        m = estimate_memory(workload_from_config(cfg), cluster)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a recipe the planner cannot model: say nothing rather than fail here
        return None
    big = m.largest
    return (f"the planner expects {m.total / GIB:.2f} GiB of tensors per device (largest: {big.name}, "
            f"{big.bytes / GIB:.2f} GiB; `accelrun plan` shows all)")


def out_of_memory(e: BaseException, cfg, device: torch.device, phase: str) -> OutOfMemory:
    tried = _TRIED.search(str(e))
    want = ""
    if tried:
        size = float(tried.group(1)) * _UNITS[tried.group(2).lower()]
        want = f" (an allocation of {size / GIB:.2f} GiB failed)"
    have = device_memory_gib(device, cfg.parallel.nproc_per_node)
    parts = [f"out of memory on {device} {phase}{want}"]
    if have is not None:
        share = " (its share of the host's RAM)" if device.type == "cpu" and cfg.parallel.nproc_per_node > 1 else ""
        parts.append(f"the device has {have:.1f} GiB{share}")
    estimate = planner_estimate(cfg, have)
    if estimate:
        parts.append(estimate)
    parts.append("lower train.micro_batch or train.seq_len, set train.activation_checkpoint.mode=full, or shard "
                 "more (parallel.dp_shard, parallel.tp)")
    return OutOfMemory("; ".join(parts))


@contextlib.contextmanager
def oom_is_the_recipes(cfg, device: torch.device, phase: str) -> Iterator[None]:
    """Inside, a failed allocation becomes ``OutOfMemory`` (a user error, exit 2)."""
    try:
        yield
    except Exception as e:
        if is_oom(e):
            raise out_of_memory(e, cfg, device, phase) from None
        raise

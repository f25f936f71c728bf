"""Mixed precision: bf16 autocast around forward, fp32 master weights and optimizer state."""

from __future__ import annotations

import contextlib

import torch


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()

"""Where a variant's step spends its device time, kernel by kernel: torch's profiler over a few steps
after the timed rounds, summed by kernel and by kind (products, attention, generated kernels, copies).

On a GPU this is the table that says which kernels make one compiler's step slower than another's
(the 8-layer Llama's bf16 step at 0.96× Inductor's, docs/gpu.md); on a CPU the rows are ATen's ops
only (accelrun's C++ regions and Inductor's kernels run inside their graphs' calls, unnamed).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Kinds of kernel, first match wins: one table for every variant, so their rows add up alike.
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("products", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|^aten::(mm|addmm|bmm|matmul|linear)$", re.I)),
    ("generated", re.compile(r"^triton|^cpp_fused|accelrun", re.I)),
    ("copies", re.compile(r"memcpy|memset|^aten::(copy_|fill_|zero_|clone|contiguous)$", re.I)),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


@dataclass(frozen=True)
class KernelRow:
    name: str
    calls_per_step: float
    us_per_step: float

    @property
    def kind(self) -> str:
        return kind_of(self.name)


@dataclass(frozen=True)
class KernelTable:
    variant: str
    steps: int
    on_device: bool  # device kernels' own time (GPU), else the host ops' own time (CPU)
    rows: tuple[KernelRow, ...]  # the most time first

    def by_kind(self) -> dict[str, float]:
        """Microseconds per step by kind of kernel, in KINDS' order, then "other"."""
        totals = {kind: 0.0 for kind, _ in KINDS} | {"other": 0.0}
        for row in self.rows:
            totals[row.kind] += row.us_per_step
        return totals

    def text(self, top: int = 30) -> str:
        where = "device" if self.on_device else "host (ATen ops)"
        lines = [f"{self.variant}: {where} time per step over {self.steps} profiled steps, "
                 f"{sum(r.us_per_step for r in self.rows) / 1000:.2f} ms in all"]  # fmt: skip
        lines += [f"  {kind:<10} {us / 1000:8.3f} ms" for kind, us in self.by_kind().items()]
        lines.append(f"  {'us/step':>9} {'calls':>6} kind       kernel")
        for r in self.rows[:top]:
            lines.append(f"  {r.us_per_step:9.1f} {r.calls_per_step:6.1f} {r.kind:<10} {r.name[:100]}")
        return "\n".join(lines)


def profile_steps(variant: str, step: Callable[[], object], steps: int, device: torch.device) -> KernelTable:
    """Runs ``step`` ``steps`` times under torch's profiler; each kernel's own time, per step."""
    from torch.profiler import ProfilerActivity, profile

    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    rows = []
    for event in prof.key_averages():
        # On a GPU only the kernels themselves: torch also gives the ATen op that launched a kernel its
        # device time, and both rows would count (torch's own table sums device events alone).
        if on_device and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = event.self_device_time_total if on_device else event.self_cpu_time_total
        if us <= 0 or (not on_device and not event.key.startswith("aten::")):
            continue
        rows.append(KernelRow(event.key, event.count / steps, us / steps))
    rows.sort(key=lambda r: r.us_per_step, reverse=True)
    return KernelTable(variant, steps, on_device, tuple(rows))


def side_by_side(tables: list[KernelTable]) -> str:
    """One line per kind, a column per variant (ms per step)."""
    kinds = [kind for kind, _ in KINDS] + ["other"]
    head = "| kind | " + " | ".join(t.variant for t in tables) + " |"
    lines = [head, "|" + " --- |" * (len(tables) + 1)]
    for kind in [*kinds, "all"]:
        cells = [sum(t.by_kind().values()) if kind == "all" else t.by_kind()[kind] for t in tables]
        lines.append(f"| {kind} | " + " | ".join(f"{us / 1000:.3f} ms" for us in cells) + " |")
    return "\n".join(lines)


def write_tables(tables: list[KernelTable], directory: Path, precision: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"kernels-{precision}.txt"
    path.write_text(side_by_side(tables) + "\n\n" + "\n\n".join(t.text() for t in tables) + "\n")
    return path

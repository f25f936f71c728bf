"""Accelerator kinds a cluster description can name, with memory size, memory bandwidth and link.

Peaks are not repeated here: each kind names its entry in ``accelrun.report.gpu_table`` (the table
MFU uses), so a corrected datasheet figure changes the planner and the reports together. This table
adds what planning needs beyond peaks, each figure from the same vendor datasheet:

- ``memory_gib``: device memory as the datasheet states it ("80GB" HBM is 80 GiB of DRAM: HBM and
  GDDR capacities are binary). What tensors can use is this minus the cluster's ``reserved_gib``.
- ``memory_bandwidth_gbs``: peak DRAM bandwidth, GB/s (10^9 bytes).
- ``link_gbs``: the default intra-node link, GB/s per device in each direction (NVLink's datasheet
  figure is the bidirectional total, halved here; PCIe x16 likewise).

``cpu`` and ``custom`` have no figures: a cluster description declares them, or
``accelrun plan --calibrate`` measures them.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelrun.report.gpu_table import GPU_PEAKS, GpuEntry


@dataclass(frozen=True)
class Accelerator:
    kind: str  # the name a cluster description uses
    peak_entry: str  # GpuEntry.entry in accelrun.report.gpu_table
    memory_gib: float
    memory_bandwidth_gbs: float
    link_gbs: float
    link: str  # what the intra-node link is
    source: str

    @property
    def peaks(self) -> GpuEntry:
        return peak_entry(self.peak_entry)


ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator("h100-sxm", "NVIDIA H100 SXM5", 80, 3350, 450, "NVLink 4 (900 GB/s bidirectional)",
                "NVIDIA H100 Tensor Core GPU datasheet (SXM: 80GB HBM3, 3.35 TB/s)"),
    Accelerator("h100-pcie", "NVIDIA H100 PCIe", 80, 2000, 64, "PCIe Gen5 x16 (128 GB/s bidirectional)",
                "NVIDIA H100 Tensor Core GPU datasheet (PCIe: 80GB HBM2e, 2 TB/s)"),
    Accelerator("h100-nvl", "NVIDIA H100 NVL", 94, 3900, 300, "NVLink bridge (600 GB/s bidirectional)",
                "NVIDIA H100 Tensor Core GPU datasheet (NVL: 94GB HBM3, 3.9 TB/s)"),
    Accelerator("h200-sxm", "NVIDIA H200 SXM", 141, 4800, 450, "NVLink 4 (900 GB/s bidirectional)",
                "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141GB HBM3e, 4.8 TB/s)"),
    Accelerator("h200-nvl", "NVIDIA H200 NVL", 141, 4800, 450, "NVLink bridge (900 GB/s bidirectional)",
                "NVIDIA H200 Tensor Core GPU datasheet (NVL: 141GB HBM3e, 4.8 TB/s)"),
    Accelerator("a100-40gb-sxm", "NVIDIA A100 40GB", 40, 1555, 300, "NVLink 3 (600 GB/s bidirectional)",
                "NVIDIA A100 Tensor Core GPU datasheet (40GB HBM2, 1,555 GB/s)"),
    Accelerator("a100-80gb-sxm", "NVIDIA A100 80GB", 80, 2039, 300, "NVLink 3 (600 GB/s bidirectional)",
                "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: HBM2e, 2,039 GB/s)"),
    Accelerator("a100-80gb-pcie", "NVIDIA A100 80GB", 80, 1935, 32, "PCIe Gen4 x16 (64 GB/s bidirectional)",
                "NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe: HBM2e, 1,935 GB/s)"),
    Accelerator("l40s", "NVIDIA L40S", 48, 864, 32, "PCIe Gen4 x16 (64 GB/s bidirectional)",
                "NVIDIA L40S GPU datasheet (48GB GDDR6, 864 GB/s)"),
    Accelerator("l4", "NVIDIA L4", 24, 300, 32, "PCIe Gen4 x16 (64 GB/s bidirectional)",
                "NVIDIA L4 Tensor Core GPU datasheet (24GB GDDR6, 300 GB/s)"),
    Accelerator("a10", "NVIDIA A10", 24, 600, 32, "PCIe Gen4 x16 (64 GB/s bidirectional)",
                "NVIDIA A10 Tensor Core GPU datasheet (24GB GDDR6, 600 GB/s)"),
    Accelerator("rtx-4090", "NVIDIA GeForce RTX 4090", 24, 1008, 32, "PCIe Gen4 x16 (64 GB/s bidirectional)",
                "NVIDIA Ada GPU Architecture whitepaper, RTX 4090 (24GB GDDR6X, 1,008 GB/s)"),
    Accelerator("v100-sxm2-32gb", "NVIDIA V100 SXM2", 32, 900, 150, "NVLink 2 (300 GB/s bidirectional)",
                "NVIDIA Tesla V100 GPU datasheet (SXM2 32GB HBM2, 900 GB/s)"),
    Accelerator("mi300x", "AMD Instinct MI300X", 192, 5300, 448,
                "Infinity Fabric, 7 links x 128 GB/s bidirectional (all links used by a collective)",
                "AMD Instinct MI300X data sheet (192GB HBM3, 5.3 TB/s)"),
)

# Kinds with no built-in figures: the cluster description declares them (or calibration measures).
DECLARED_KINDS = ("cpu", "custom")


def peak_entry(name: str) -> GpuEntry:
    for e in GPU_PEAKS:
        if e.entry == name:
            return e
    raise KeyError(f"no entry {name!r} in accelrun.report.gpu_table")


def find_accelerator(kind: str) -> Accelerator | None:
    for a in ACCELERATORS:
        if a.kind == kind:
            return a
    return None


def known_kinds() -> list[str]:
    return [a.kind for a in ACCELERATORS] + list(DECLARED_KINDS)

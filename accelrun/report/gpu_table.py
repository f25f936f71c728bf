"""Datasheet peaks of known GPUs, for MFU.

Each entry is matched against the whole name that ``torch.cuda.get_device_name`` reports (a regular
expression, full match, case-insensitive), never against a fragment of it: a name that is not listed
is an unknown GPU and gets no peak, rather than the peak of the nearest-looking product.

Figures are dense (no structured sparsity) per-device TFLOP/s from the vendor's datasheet:

- ``bf16``: the BF16 tensor-core peak with FP32 accumulate, which is what bf16-mixed matmuls run at.
  Datasheets that print only the with-sparsity figure (Hopper, Ada) are halved here.
- ``fp32``: the non-tensor-core FP32 peak. accelrun leaves torch's float32 matmul precision at its
  default ("highest"), so fp32 matmuls do not use TF32 tensor cores; if a user turns TF32 on, this
  peak understates the device and MFU can exceed 1, so they should declare ``report.peak_tflops``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuEntry:
    entry: str  # product as the datasheet names it
    names: str  # regex, full match against torch.cuda.get_device_name()
    bf16_tflops: float | None  # None: the device has no bf16 tensor cores
    fp32_tflops: float
    datasheet: str

    def cited_for(self, precision: str) -> str:
        """The datasheet as a peak of ``precision`` cites it: its note on the BF16 figure only for bf16 (a
        plan's fp32 peak of 67 TFLOP/s was cited "(BF16 1,979 with sparsity)")."""
        if precision.startswith("bf16") or "(BF16" not in self.datasheet:
            return self.datasheet
        return self.datasheet.split(" (BF16")[0]


GPU_PEAKS: tuple[GpuEntry, ...] = (
    GpuEntry("NVIDIA H100 SXM5", r"NVIDIA H100 80GB HBM3|NVIDIA H100 SXM5?( 80GB)?", 989.5, 67.0,
             "NVIDIA H100 Tensor Core GPU datasheet (BF16 1,979 with sparsity)"),
    GpuEntry("NVIDIA H100 PCIe", r"NVIDIA H100 PCIe", 756.5, 51.0,
             "NVIDIA H100 Tensor Core GPU datasheet (BF16 1,513 with sparsity)"),
    GpuEntry("NVIDIA H100 NVL", r"NVIDIA H100 NVL", 835.5, 60.0,
             "NVIDIA H100 Tensor Core GPU datasheet (BF16 1,671 with sparsity)"),
    GpuEntry("NVIDIA H200 SXM", r"NVIDIA H200( 141GB HBM3e)?", 989.5, 67.0,
             "NVIDIA H200 Tensor Core GPU datasheet (BF16 1,979 with sparsity)"),
    GpuEntry("NVIDIA H200 NVL", r"NVIDIA H200 NVL", 835.5, 60.0,
             "NVIDIA H200 Tensor Core GPU datasheet (BF16 1,671 with sparsity)"),
    GpuEntry("NVIDIA A100 40GB", r"NVIDIA A100-(SXM4|PCIE)-40GB", 312.0, 19.5,
             "NVIDIA A100 Tensor Core GPU datasheet"),
    GpuEntry("NVIDIA A100 80GB", r"NVIDIA A100-SXM4-80GB|NVIDIA A100 80GB PCIe", 312.0, 19.5,
             "NVIDIA A100 Tensor Core GPU datasheet"),
    GpuEntry("NVIDIA L4", r"NVIDIA L4", 121.0, 30.3,
             "NVIDIA L4 Tensor Core GPU datasheet (BF16 242 with sparsity)"),
    GpuEntry("NVIDIA L40S", r"NVIDIA L40S", 362.05, 91.6,
             "NVIDIA L40S GPU datasheet"),
    GpuEntry("NVIDIA A10", r"NVIDIA A10", 125.0, 31.2,
             "NVIDIA A10 Tensor Core GPU datasheet"),
    GpuEntry("NVIDIA V100 SXM2", r"Tesla V100-SXM2-(16|32)GB", None, 15.7,
             "NVIDIA Tesla V100 GPU datasheet"),
    GpuEntry("NVIDIA V100 PCIe", r"Tesla V100-PCIE-(16|32)GB", None, 14.0,
             "NVIDIA Tesla V100 GPU datasheet"),
    GpuEntry("NVIDIA V100S PCIe", r"Tesla V100S-PCIE-32GB", None, 16.4,
             "NVIDIA Tesla V100S GPU datasheet"),
    GpuEntry("NVIDIA GeForce RTX 4090", r"NVIDIA GeForce RTX 4090", 165.2, 82.6,
             "NVIDIA Ada GPU Architecture whitepaper, RTX 4090 (BF16 with FP32 accumulate)"),
    GpuEntry("AMD Instinct MI300X", r"AMD Instinct MI300X( OAM)?", 1307.4, 163.4,
             "AMD Instinct MI300X data sheet"),
)

# Names people ask about that are deliberately absent, with the reason shown to the user.
NOT_LISTED: dict[str, str] = {
    r"NVIDIA A10G": "NVIDIA publishes no datasheet for the A10G (an AWS-only variant of the A10 with "
                    "different clocks), so accelrun has no figure it can cite",
}


def find_gpu_entry(name: str) -> GpuEntry | None:
    """The table entry whose pattern matches the whole device name, or None."""
    name = " ".join(name.split())
    for e in GPU_PEAKS:
        if re.fullmatch(e.names, name, flags=re.IGNORECASE):
            return e
    return None


def why_not_listed(name: str) -> str:
    """A sentence saying why ``name`` has no table entry."""
    name = " ".join(name.split())
    if re.search(r"\bMIG\b", name):
        return (f"{name!r} is a MIG slice; its peak is a fraction of the whole GPU's that accelrun "
                "cannot know")
    for pattern, reason in NOT_LISTED.items():
        if re.fullmatch(pattern, name, flags=re.IGNORECASE):
            return reason
    return f"{name!r} is not in accelrun's table of known GPUs"

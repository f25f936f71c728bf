"""Predictions against torchtitan's published Llama 3.1 8B runs (pure arithmetic, no torch).

Source: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (December 2024): H100
96 GB HBM2e at 500 W (Grand Teton), FSDP, bf16, local batch 2, sequence 8192, selective (per-op)
activation checkpointing; tokens/s per GPU and peak memory (the allocator's reserved peak, GiB).
The cluster is ``recipes/cluster/h100-96gb-grand-teton.yaml``; the efficiency constants are
``accelrun/plan/efficiency.py``'s, the same for every case.

``python tests/plan/test_plan_published.py`` prints the comparison table.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from accelrun.plan import PlanOptions, load_plan_config, predict
from accelrun.plan.memory import GIB

THROUGHPUT_TOLERANCE = 0.25
MEMORY_TOLERANCE = 0.20


@dataclass(frozen=True)
class Published:
    gpus: int
    compiled: bool
    tokens_per_s_per_gpu: float
    memory_gib: float


PUBLISHED = (
    Published(8, False, 5762, 82.4),
    Published(8, True, 6667, 77.0),
    Published(128, False, 5605, 67.0),
    Published(128, True, 6514, 62.0),
)


def torchtitan_overrides(gpus: int, compiled: bool) -> list[str]:
    nodes = gpus // 8
    return [
        "data.source=synthetic", "train.seq_len=8192", "train.micro_batch=2", f"train.global_batch={2 * gpus}",
        "train.precision=bf16-mixed", f"parallel.nnodes={nodes}", "parallel.nproc_per_node=8",
        "parallel.dp_replicate=1", "parallel.dp_shard=-1", "parallel.tp=1", "parallel.pp=1",
        f"compile.backend={'inductor' if compiled else 'eager'}", f"cluster.nodes={nodes}",
    ]


def predicted(case: Published):
    loaded = load_plan_config("model/llama3-8b", torchtitan_overrides(case.gpus, case.compiled),
                              cluster="h100-96gb-grand-teton")
    return predict(loaded.resolved.config, PlanOptions(activation_checkpoint="selective"))


def comparison_rows() -> list[tuple]:
    rows = []
    for case in PUBLISHED:
        p = predicted(case)
        mem = p.memory.allocator_peak / GIB
        rows.append((case.gpus, "yes" if case.compiled else "no", case.tokens_per_s_per_gpu, p.tokens_per_s_per_device,
                     p.tokens_per_s_per_device / case.tokens_per_s_per_gpu - 1, case.memory_gib, mem,
                     mem / case.memory_gib - 1, p.mfu))
    return rows


def format_table() -> str:
    lines = ["| GPUs | compile | published tok/s/GPU | predicted | error | published GiB | predicted | error | MFU |",
             "| ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for g, c, pt, t, te, pm, m, me, mfu in comparison_rows():
        lines.append(f"| {g} | {c} | {pt:,.0f} | {t:,.0f} | {te:+.1%} | {pm:.1f} | {m:.1f} | {me:+.1%} | {mfu:.1%} |")
    return "\n".join(lines)


@pytest.mark.parametrize("case", PUBLISHED, ids=lambda c: f"{c.gpus}gpu-{'compile' if c.compiled else 'eager'}")
def test_prediction_within_tolerance_of_published(case: Published):
    p = predicted(case)
    assert p.fits
    throughput_error = p.tokens_per_s_per_device / case.tokens_per_s_per_gpu - 1
    memory_error = p.memory.allocator_peak / GIB / case.memory_gib - 1
    assert abs(throughput_error) <= THROUGHPUT_TOLERANCE, f"throughput off by {throughput_error:+.1%}"
    assert abs(memory_error) <= MEMORY_TOLERANCE, f"memory off by {memory_error:+.1%}"


def test_scaling_and_compile_move_the_way_published_figures_do():
    eager8, compiled8, eager128, compiled128 = (predicted(c) for c in PUBLISHED)
    # More GPUs: less memory (sharded states) and slightly fewer tokens/s per GPU (inter-node traffic).
    assert eager128.memory.allocator_peak < eager8.memory.allocator_peak
    assert eager128.tokens_per_s_per_device < eager8.tokens_per_s_per_device
    # Compiling fuses the elementwise work: faster at the same layout.
    assert compiled8.tokens_per_s_per_device > eager8.tokens_per_s_per_device


if __name__ == "__main__":
    print(format_table())

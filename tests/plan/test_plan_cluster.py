"""Cluster descriptions, the accelerator table, collective costs and pipeline schedules."""

from __future__ import annotations

import math

import pytest
import yaml

from accelrun.config.schema import ClusterConfig
from accelrun.plan import PlanError, resolve_cluster
from accelrun.plan import efficiency as eff
from accelrun.plan.accelerators import ACCELERATORS
from accelrun.plan.cluster import Link
from accelrun.plan.comm import all_gather_s, all_reduce_s, group_link, reduce_scatter_s
from accelrun.plan.pipeline import bubble_units, in_flight
from accelrun.plan.workload import Layout
from accelrun.report.gpu_table import GPU_PEAKS, find_gpu_entry
from tests.conftest import REPO

CLUSTER_RECIPES = sorted((REPO / "recipes" / "cluster").glob("*.yaml"))


def test_every_accelerator_takes_its_peaks_from_the_gpu_table():
    entries = {e.entry for e in GPU_PEAKS}
    for a in ACCELERATORS:
        assert a.peak_entry in entries
        assert a.memory_gib > 0 and a.memory_bandwidth_gbs > 0 and a.link_gbs > 0 and a.source


def test_h100_96gb_peaks_are_the_stated_midpoint_of_table_entries():
    data = yaml.safe_load((REPO / "recipes" / "cluster" / "h100-96gb-grand-teton.yaml").read_text())["cluster"]
    sxm, nvl = find_gpu_entry("NVIDIA H100 80GB HBM3"), find_gpu_entry("NVIDIA H100 NVL")
    assert data["bf16_tflops"] == (sxm.bf16_tflops + nvl.bf16_tflops) / 2
    assert data["fp32_tflops"] == (sxm.fp32_tflops + nvl.fp32_tflops) / 2
    assert "assumption" in data["sources"]["bf16_tflops"]


@pytest.mark.parametrize("path", [p for p in CLUSTER_RECIPES if p.stem != "cpu-local"], ids=lambda p: p.stem)
def test_shipped_cluster_recipes_resolve(path):
    c = resolve_cluster(ClusterConfig.model_validate(yaml.safe_load(path.read_text())["cluster"]))
    assert c.rates("bf16-mixed").matmul_tflops(4096) > 0 and c.intra is not None and c.inter is not None


def test_table_figures_are_scaled_by_the_constants():
    c = resolve_cluster(ClusterConfig(device="h100-sxm", devices_per_node=8))
    r = c.rates("bf16-mixed")
    assert r.matmul_tflops(4096) == pytest.approx(989.5 * eff.MATMUL_OF_PEAK)
    assert r.attention_tflops(8192) == pytest.approx(989.5 * eff.ATTENTION_OF_PEAK)
    assert r.memory_gbs == pytest.approx(3350 * eff.MEMORY_OF_PEAK)
    assert c.intra.bandwidth_gbs == pytest.approx(450 * eff.NETWORK_OF_PEAK)  # default link: the table's NVLink
    assert c.memory_gib == 80 and c.reserved_gib == eff.GPU_RESERVED_GIB


def test_measured_figures_are_used_as_they_are():
    c = resolve_cluster(ClusterConfig.model_validate({
        "device": "cpu", "devices_per_node": 2, "memory_gib": 8,
        "intra_node": {"bandwidth_gbs": 1.5, "latency_us": 40, "measured": True},
        "calibration": {"measured_at": "now", "matmul_tflops": {"fp32": {64: 0.02, 256: 0.08}},
                        "attention_tflops": {"fp32": {128: 0.01, 512: 0.03}}, "memory_bandwidth_gbs": 6.0,
                        "runtime_gib": 0.3},
    }))
    r = c.rates("fp32")
    assert r.matmul_tflops(128) == pytest.approx(0.05)  # halfway between 64 and 256 in log(width)
    assert r.matmul_tflops(16) == 0.02 and r.matmul_tflops(4096) == 0.08
    assert r.attention_tflops(256) == pytest.approx(0.02) and r.memory_gbs == 6.0
    assert r.peak_tflops == 0.08 and c.intra.bandwidth_gbs == 1.5 and c.reserved_gib == 0.3
    with pytest.raises(PlanError, match="bf16"):
        c.rates("bf16-mixed")


def test_calibrated_head_dims_and_collectives_are_used():
    c = resolve_cluster(ClusterConfig.model_validate({
        "device": "cpu", "devices_per_node": 2, "memory_gib": 8,
        "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 10, "measured": True,
                       "collectives": {"reduce_scatter": {"bandwidth_gbs": 0.5, "latency_us": 1000}}},
        "calibration": {"measured_at": "now", "matmul_tflops": {"fp32": {64: 0.1}},
                        "attention_tflops": {"fp32": {128: 0.01, 512: 0.03}}, "attention_head_dim": 64,
                        "attention_head_dim_tflops": {"fp32": {32: 0.015, 64: 0.02, 128: 0.03}},
                        "attention_head_dim_seq": 256, "memory_bandwidth_gbs": 6.0},
    }))
    r = c.rates("fp32")
    assert r.attention_tflops(256) == pytest.approx(0.02)  # no head dim: the curve as measured
    assert r.attention_tflops(256, 64) == pytest.approx(0.02)
    assert r.attention_tflops(256, 32) == pytest.approx(0.02 * 0.015 / 0.02)
    assert r.attention_tflops(128, 128) == pytest.approx(0.01 * 0.03 / 0.02)
    # reduce-scatter has its own fit; all-gather and all-reduce fall back to the link's figures
    assert reduce_scatter_s(4e6, 2, c.intra) == pytest.approx(0.5 * 4e6 / 0.5e9 + 1e-3)
    assert all_gather_s(4e6, 2, c.intra) == pytest.approx(0.5 * 4e6 / 1e9 + 1e-5)
    assert all_reduce_s(4e6, 2, c.intra) == pytest.approx(4e6 / 1e9 + 2e-5)
    assert any("reduce-scatter 0.5 GB/s + 1000 µs" in value for _, value, _ in c.figures)


@pytest.mark.parametrize("cfg, message", [
    ({}, "no cluster to plan for"),
    ({"device": "h100"}, "did you mean 'h100-sxm'"),
    ({"device": "custom", "memory_gib": 10}, "cluster.bf16_tflops"),
    ({"device": "custom"}, "cluster.memory_gib is required"),
    ({"device": "h100-sxm", "nodes": 2}, "cluster.inter_node.bandwidth_gbs"),
    ({"device": "cpu", "memory_gib": 4, "devices_per_node": 3}, "has not been measured yet"),
])
def test_incomplete_descriptions_name_the_missing_key(cfg, message):
    with pytest.raises(PlanError, match=message):
        resolve_cluster(ClusterConfig.model_validate(cfg)).rates("bf16-mixed")


def test_collective_costs():
    link = Link(100.0, 1e-5, "test")
    size = 8e9
    assert all_gather_s(size, 8, link) == pytest.approx(7 / 8 * 8e9 / 100e9 + 7e-5)
    assert reduce_scatter_s(size, 1, link) == 0.0
    ring = 2 * 7 / 8 * 8e9 / 100e9 + 14e-5
    assert all_reduce_s(size, 8, link) == pytest.approx(ring)
    tiny = 8.0  # latency-bound: the tree's 2·log2(n) hops beat the ring's 2(n-1)
    assert all_reduce_s(tiny, 64, link) == pytest.approx(2 * tiny / 100e9 + 2 * math.log2(64) * 1e-5)


def test_groups_use_the_link_they_cross():
    c = resolve_cluster(ClusterConfig.model_validate({
        "device": "h100-sxm", "devices_per_node": 8, "nodes": 4, "inter_node": {"bandwidth_gbs": 50}}))
    lay = Layout(4, 8, 1, 2, 8, 2, "1f1b", 1, True)  # tp 2 inside a node, dp_shard 8 spans 2 nodes
    assert group_link(lay, c, "tp") is c.intra
    assert group_link(lay, c, "dp_shard") is c.inter
    assert group_link(lay, c, "dp_replicate") is c.inter
    assert group_link(lay, c, "pp") is None
    within = Layout(4, 8, 1, 4, 4, 2, "1f1b", 1, True)  # dp_shard 4 × tp 2 = one node
    assert group_link(within, c, "dp_shard") is c.intra


def test_pipeline_schedules():
    assert bubble_units("1f1b", 1) == 0 and bubble_units("gpipe", 4) == 3 == bubble_units("1f1b", 4)
    assert bubble_units("interleaved_1f1b", 4) == 1.5 and bubble_units("zero_bubble", 4) == 0.5
    assert in_flight("gpipe", 4, 8) == 8 and in_flight("1f1b", 4, 8) == 4 and in_flight("1f1b", 4, 2) == 2
    assert in_flight("interleaved_1f1b", 4, 8) == pytest.approx(4 * (1 + 3 / 8))
    # Zero bubble warms up one forward per later rank, not two (torch's schedule; test_plan_pipeline_memory.py).
    assert in_flight("zero_bubble", 4, 8) == 4

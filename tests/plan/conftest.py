"""A small declared cluster for plan tests: 2 nodes × 4 devices, round figures."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

TEST_CLUSTER = """
cluster:
  device: custom
  devices_per_node: 4
  nodes: 2
  memory_gib: 16
  reserved_gib: 0.5
  memory_bandwidth_gbs: 1000
  bf16_tflops: 200
  fp32_tflops: 20
  intra_node: {bandwidth_gbs: 100, latency_us: 5}
  inter_node: {bandwidth_gbs: 10, latency_us: 10}
"""


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "test-cluster.yaml"
    path.write_text(textwrap.dedent(TEST_CLUSTER).lstrip())
    return path

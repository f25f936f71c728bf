"""Collective costs: ring and tree algorithms over the link a process group actually crosses.

Costs follow the usual alpha-beta model, ``S`` the full (unsharded) message size in bytes, ``n``
ranks, ``B`` the achieved bus bandwidth per device, ``a`` the per-hop latency:

- all-gather, reduce-scatter (ring): (n-1)/n · S/B + (n-1)·a
- all-reduce: the cheaper of ring, 2(n-1)/n · S/B + 2(n-1)·a, and a double binary tree,
  2·S/B + 2·log2(n)·a (what NCCL picks between for small messages at scale)
- send/recv: S/B + a

Groups follow the mesh order (pp, dp_replicate, dp_shard, tp), tensor parallelism innermost: a
group whose ranks all sit in one node uses the intra-node link; any group that spans nodes is
limited by the inter-node link (one NIC per device, rail-optimised). A calibrated link may carry
its own bandwidth and latency per collective (``Link.cost``).
"""

from __future__ import annotations

import math

from accelrun.config.schema import MESH_ORDER  # outermost first; defined once, with the schema
from accelrun.plan.cluster import Cluster, Link
from accelrun.plan.errors import PlanError
from accelrun.plan.workload import Layout


def _ring_half(collective: str, size: float, n: int, link: Link) -> float:
    if n <= 1 or size <= 0:
        return 0.0
    bw, hop = link.cost(collective)
    return (n - 1) / n * size / bw + (n - 1) * hop


def all_gather_s(size: float, n: int, link: Link) -> float:
    return _ring_half("all_gather", size, n, link)


def reduce_scatter_s(size: float, n: int, link: Link) -> float:
    return _ring_half("reduce_scatter", size, n, link)


def all_reduce_s(size: float, n: int, link: Link) -> float:
    if n <= 1 or size <= 0:
        return 0.0
    bw, hop = link.cost("all_reduce")
    ring = 2 * (n - 1) / n * size / bw + 2 * (n - 1) * hop
    tree = 2 * size / bw + 2 * math.ceil(math.log2(n)) * hop
    return min(ring, tree)


def send_s(size: float, link: Link) -> float:
    return size / (link.bandwidth_gbs * 1e9) + link.latency_s if size > 0 else 0.0


def group_link(layout: Layout, cluster: Cluster, dim: str) -> Link | None:
    """The link that limits collectives over mesh dimension ``dim`` (None for a group of one)."""
    size = getattr(layout, dim)
    if size <= 1:
        return None
    stride = 1
    for d in reversed(MESH_ORDER):  # innermost first
        if d == dim:
            break
        stride *= getattr(layout, d)
    span = stride * size  # consecutive ranks one group covers
    within_node = span <= layout.nproc_per_node and layout.nproc_per_node % span == 0
    link = cluster.intra if within_node else cluster.inter
    if link is None:
        where = "within a node" if within_node else "between nodes"
        raise PlanError(f"parallel.{dim} = {size} communicates {where}, but the cluster declares no such link")
    return link

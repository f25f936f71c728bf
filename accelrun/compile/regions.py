"""Fusion regions: groups of nodes of an ATen graph that one executor compiles as one kernel.

The ``partition_regions`` pass marks each node it groups with ``node.meta[REGION_KEY] = region id``;
``lower.py`` then cuts each region out of the graph as a standalone ``GraphModule`` (inputs become
placeholders, values used outside become outputs) and asks the executors, in priority order, to
take it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

REGION_KEY = "accelrun_region"


@dataclass
class Region:
    id: int
    gm: fx.GraphModule  # placeholders = the region's inputs; output = tuple of the values used outside
    # Tensors (usually fake, from node.meta["val"]) describing each input and output: shape, stride, dtype.
    input_meta: list[Any]
    output_meta: list[Any]
    graph_kind: str = "forward"  # forward | backward | inference
    facts: dict[str, Any] = field(default_factory=dict)  # what executors looked at (for explain)

    @property
    def ops(self) -> list[str]:
        return [_op_name(n.target) for n in self.gm.graph.nodes if n.op == "call_function"]

    def describe(self) -> str:
        names = self.ops
        shown = ", ".join(names[:6]) + (", …" if len(names) > 6 else "")
        return f"region {self.id}: {len(names)} ops ({shown})"


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__ if target._overloadname == "default" else str(target).replace(
            "aten.", ""
        )
    return getattr(target, "__name__", str(target))


def op_name(target: Any) -> str:
    """Short readable name of an FX call target: ``add``, ``sum.dim_IntList``, ``getitem``."""
    return _op_name(target)


def regions_of(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    """Region id → its nodes in graph order, as marked by the partitioner."""
    out: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        rid = node.meta.get(REGION_KEY)
        if rid is not None:
            out.setdefault(rid, []).append(node)
    return out

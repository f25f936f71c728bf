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
class GeneratedSource:
    """A code generator's source for a region (kept per generator: the dump shows the one that runs)."""

    text: str
    ext: str  # the dump's file extension: cpp, py


@dataclass
class RegionLowering:
    """What the lowering learned about a region: who runs it, who declined and why, what it cost.
    Written by ``lower.py`` and the executors; read by the record, the explain dump and the tests."""

    executor: str | None = None  # the executor that runs it; None until one claimed and compiled it
    compile_s: float = 0.0
    declined: dict[str, str] = field(default_factory=dict)  # executor name → why it did not take the region
    cache_hit: bool | None = None  # the executor's own cache supplied the compiled code; None: no cache
    sources: dict[str, GeneratedSource] = field(default_factory=dict)  # executor name → its generated source


@dataclass
class Region:
    id: int
    gm: fx.GraphModule  # placeholders = the region's inputs; output = tuple of the values used outside
    # Tensors (usually fake, from node.meta["val"]) describing each input and output: shape, stride, dtype.
    input_meta: list[Any]
    output_meta: list[Any]
    graph_kind: str = "forward"  # forward | backward | inference
    input_names: tuple[str, ...] = ()  # the enclosing graph's nodes that feed the region
    output_names: tuple[str, ...] = ()  # ... and those it computes that are used outside it
    lowering: RegionLowering = field(default_factory=RegionLowering)
    # The loop program both code generators read (codegen.loop_ir.cached_program builds it once), or why
    # the loop IR cannot express the region.
    program: Any = None
    program_error: str | None = None
    # Why the region's changing size could not be read at each call (codegen.runtime_rows), if tried.
    runtime_rows_error: str | None = None

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

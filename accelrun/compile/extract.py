"""Cut marked fusion regions out of an ATen graph, and put compiled ones back.

``extract_regions(gm)`` turns each region (nodes sharing ``meta[REGION_KEY]``) into a standalone
``GraphModule``: its placeholders are the values it reads from outside, in the order its nodes first
read them (graph order, args before kwargs); its output is the tuple of its values used outside
(by another node or by the graph's output), in graph order. ``meta["val"]`` travels with every node,
so shapes, strides and dtypes are known to an executor.

``replace_regions(gm, compiled)`` builds a new module in which each region named in ``compiled`` is
one call of its compiled callable (same inputs, same output tuple as the region's module) followed
by a ``getitem`` per output. Regions are never side-effecting (the partitioner admits pure ops only)
so nodes may move: the new graph is a topological order of nodes and regions that keeps each unit
as early as its original position allows.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from accelrun.compile.regions import REGION_KEY, Region, regions_of
from accelrun.torch_private import LazyGraphModule

# meta key on the node that calls a compiled region: the region's id.
FUSED_REGION_KEY = "accelrun_fused_region"


def region_boundary(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(values read from outside, values used outside) of a region given its nodes in graph order.

    ``extract_regions`` and ``replace_regions`` both use this, so a region module's placeholders and
    outputs line up with the call that replaces it.
    """
    members = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for node in nodes:
        for inp in node.all_input_nodes:
            if inp not in members:
                inputs.setdefault(inp)
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    return list(inputs), outputs


def _meta_val(node: fx.Node) -> Any:
    return node.meta.get("val")


def extract_regions(gm: fx.GraphModule, graph_kind: str = "forward") -> list[Region]:
    """Each marked region of ``gm`` as a ``Region`` with its own module, in order of region id."""
    return [region_of(rid, nodes, graph_kind) for rid, nodes in sorted(regions_of(gm).items())]


def region_of(rid: int, nodes: list[fx.Node], graph_kind: str = "forward",
              outputs: list[fx.Node] | None = None) -> Region:  # fmt: skip
    """``nodes`` (in graph order) as a ``Region`` with its own module; ``outputs``: the values it returns,
    by default those used outside it."""
    inputs, used_outside = region_boundary(nodes)
    outputs = used_outside if outputs is None else outputs
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for inp in inputs:
        ph = graph.placeholder(inp.name)
        ph.meta["val"] = _meta_val(inp)
        if "tensor_meta" in inp.meta:
            ph.meta["tensor_meta"] = inp.meta["tensor_meta"]
        env[inp] = ph
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    # Lazy: its Python code is written only if something runs or reads it (the aten executor, a
    # dump); a region a code generator claims never needs it (27 regions: ~30 ms of a cold step).
    region_gm = LazyGraphModule(torch.nn.Module(), graph, class_name=f"Region{rid}")
    return Region(rid, region_gm, [_meta_val(n) for n in inputs], [_meta_val(n) for n in outputs],
                  graph_kind, tuple(n.name for n in inputs), tuple(n.name for n in outputs))


def named_call(fn: Callable[..., Any], rid: int) -> Callable[..., Any]:
    """A plain function wrapping ``fn`` with a readable name for the generated code."""

    def call(*args: Any) -> Any:
        return fn(*args)

    call.__name__ = call.__qualname__ = f"accelrun_region_{rid}"
    call.compiled = fn  # type: ignore[attr-defined]  # what the call runs, for explain and tests
    return call


def replace_regions(gm: fx.GraphModule, compiled: dict[int, Callable[..., Any]]) -> fx.GraphModule:
    """A new module where each region in ``compiled`` runs as one call; ``gm`` is left unchanged."""
    regions = regions_of(gm)
    missing = sorted(set(compiled) - set(regions))
    if missing:
        raise KeyError(f"replace_regions: no region with id {missing} in the graph (has {sorted(regions)})")
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    # A unit is a node, or a whole region being replaced; the new graph is a topological order of units.
    unit_of: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        rid = node.meta.get(REGION_KEY)
        unit_of[node] = ("region", rid) if rid in compiled else node
    members: dict[Any, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        members.setdefault(unit_of[node], []).append(node)

    deps: dict[Any, set[Any]] = {u: set() for u in members}
    users: dict[Any, set[Any]] = {u: set() for u in members}
    for unit, nodes in members.items():
        for node in nodes:
            for inp in node.all_input_nodes:
                if unit_of[inp] != unit:
                    deps[unit].add(unit_of[inp])
                    users[unit_of[inp]].add(unit)

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    waiting = {u: len(d) for u, d in deps.items()}
    emitted = 0
    ready = [(index[nodes[0]], unit) for unit, nodes in members.items() if not deps[unit]]
    heapq.heapify(ready)
    while ready:
        _, unit = heapq.heappop(ready)
        emitted += 1
        if isinstance(unit, fx.Node):
            env[unit] = graph.node_copy(unit, env.__getitem__)
        else:
            _emit_region(graph, env, unit[1], members[unit], compiled[unit[1]])
        for user in users[unit]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (index[members[user][0]], user))
    if emitted < len(members):
        raise AssertionError("replace_regions: regions form a cycle; the partitioner should have refused it")
    new_gm = fx.GraphModule(gm, graph)
    new_gm.graph.lint()
    return new_gm


def _emit_region(graph: fx.Graph, env: dict[fx.Node, fx.Node], rid: int, nodes: list[fx.Node],
                 fn: Callable[..., Any]) -> None:
    inputs, outputs = region_boundary(nodes)
    call = graph.create_node("call_function", named_call(fn, rid), tuple(env[i] for i in inputs),
                             name=f"region_{rid}")
    call.meta["val"] = tuple(_meta_val(o) for o in outputs)
    call.meta[FUSED_REGION_KEY] = rid
    # a dump shows the call under its first op's source line (torch's printer said "No stacktrace found")
    if (trace := next((n.meta["stack_trace"] for n in nodes if n.meta.get("stack_trace")), None)) is not None:
        call.meta["stack_trace"] = trace
    for k, out in enumerate(outputs):
        item = graph.create_node("call_function", operator.getitem, (call, k), name=out.name)
        item.meta = {key: v for key, v in out.meta.items() if key != REGION_KEY}
        env[out] = item

"""The lowered graph as it runs: ATen calls without the Python layers a readable graph keeps.

A lowered graph calls ops as ``torch.ops.aten.view.default(x, ...)``: readable in dumps and
picklable by name for the graph cache, but each call passes through ``OpOverload.__call__``, a
Python frame in front of the C++ binding. The debug Llama's step makes about 1,500 such calls,
most of them views around the matmuls, and on this CPU a view costs 9 µs through the OpOverload
and 3 µs as the Tensor method. So the graph that runs is a copy with the views (and ``mm``) called
as Tensor methods; the graph kept for dumps and the cache is unchanged.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

# The same ATen op as a Tensor method with the same positional arguments.
AS_METHODS = {
    aten.view.default: torch.Tensor.view,
    aten.permute.default: torch.Tensor.permute,
    aten.t.default: torch.Tensor.t,
    aten.unsqueeze.default: torch.Tensor.unsqueeze,
    aten.squeeze.dims: torch.Tensor.squeeze,
    aten.squeeze.dim: torch.Tensor.squeeze,
    aten.expand.default: torch.Tensor.expand,
    aten.select.int: torch.Tensor.select,
    aten.mm.default: torch.Tensor.mm,
}


def runnable(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose views and matmuls skip ``OpOverload.__call__`` (same ops, same arguments)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in AS_METHODS and not node.kwargs:
            node.target = AS_METHODS[node.target]
    return fx.GraphModule(gm, graph)

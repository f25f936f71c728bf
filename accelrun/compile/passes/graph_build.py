"""Inserting ATen calls into an FX graph, each with its fake value (later passes and the executors
read ``meta['val']``): what the rewriting passes share."""

from __future__ import annotations

import torch
from torch import fx

from accelrun.torch_private import detect_fake_mode


def tensor_val(node: object) -> torch.Tensor | None:
    """A node's (fake) tensor value, or None (not a node, no value, a SymInt)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _value(a: object) -> object:
    """What a node stands for while building (its fake tensor, or the symbolic size it is), or ``a``."""
    if not isinstance(a, fx.Node):
        return a
    val = a.meta.get("val")
    return val if isinstance(val, (torch.Tensor, torch.SymInt)) else None


class NodeBuilder:
    """Inserts ATen calls before a node; ``fake_mode`` is None when the graph's values do not come
    from one fake mode (a hand-traced graph), and then nothing may be built."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.graph = gm.graph
        try:
            self.fake_mode = detect_fake_mode([v for n in gm.graph.nodes if (v := tensor_val(n)) is not None])
        except AssertionError:  # values from several fake modes
            self.fake_mode = None

    def __call__(self, before: fx.Node, target, *args, **kwargs) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs)
        vals = [_value(a) for a in args]
        vals = [[_value(x) for x in a] if isinstance(a, list) else a for a in vals]
        with self.fake_mode:
            node.meta["val"] = target(*vals, **kwargs)
        return node

"""graph_snapshot (the copy a failing pass is rolled back to) prints no torch FutureWarning: deep-copying
the graph's pytree specs rebuilt LeafSpecs, deprecated in torch, on every compiled run (issue 30, item 9)."""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils._pytree import tree_flatten

from accelrun.compile.backend import graph_snapshot


def _pytree_graph_module() -> fx.GraphModule:
    gm = fx.symbolic_trace(lambda x, y: (x + y, x * y))
    _, in_spec = tree_flatten(((torch.ones(1), torch.ones(1)), {}))
    _, out_spec = tree_flatten((torch.ones(1), torch.ones(1)))
    gm.graph._codegen = _PyTreeCodeGen(_PyTreeInfo(["x", "y"], in_spec, out_spec))
    gm.recompile()
    return gm


def test_snapshot_of_a_pytree_graph_warns_nothing_and_keeps_its_signature():
    gm = _pytree_graph_module()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        snap = graph_snapshot(gm).restore()
    assert not [w for w in seen if "LeafSpec" in str(w.message)], [str(w.message) for w in seen]
    info, old = snap.graph._codegen.pytree_info, gm.graph._codegen.pytree_info
    assert (info.in_spec, info.out_spec) == (old.in_spec, old.out_spec)
    assert info.orig_args == old.orig_args and info.orig_args is not old.orig_args  # a rollback's own list
    x, y = torch.randn(3), torch.randn(3)
    assert all(torch.equal(a, b) for a, b in zip(snap(x, y), (x + y, x * y), strict=True))

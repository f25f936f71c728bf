"""What passes learn about one Dynamo graph reaches the later passes and stages (``GraphNotes``)."""

from __future__ import annotations

import torch

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes import remat as remat_module
from accelrun.compile.passes.base import resolve_passes


def _sin_chain(x: torch.Tensor) -> torch.Tensor:
    # Pointwise chains in the forward and in the backward: regions in both graphs.
    return torch.sin(x * 2 + 1).exp() * 3


def test_forward_and_backward_regions_get_distinct_ids():
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["partition_regions"]), executors=["aten"]))
    x = torch.randn(8, 16, requires_grad=True)
    torch.compile(_sin_chain, backend=backend)(x).sum().backward()
    ids = {kind: {r.region for r in backend.record.regions if r.graph == f"g0.{kind}"}
           for kind in ("forward", "backward")}  # fmt: skip
    assert ids["forward"] and ids["backward"], backend.record.regions
    # partition_regions numbers from the graph's next free id; rebuilt notes started both graphs at 0.
    assert not ids["forward"] & ids["backward"], ids


def test_remat_gets_aot_autograds_count_of_forward_outputs(monkeypatch):
    seen: list[int | None] = []
    real = remat_module.rematerialize

    def spy(fw, bw, budget, kinds, max_chain, num_fwd_outputs=None, unreadable=frozenset()):
        seen.append(num_fwd_outputs)
        return real(fw, bw, budget, kinds, max_chain, num_fwd_outputs, unreadable)

    monkeypatch.setattr(remat_module, "rematerialize", spy)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["remat"]), executors=["aten"]))

    def two_outputs(x):
        return x.sin() * 2, x.cos().exp()

    x = torch.randn(4, 8, requires_grad=True)
    a, b = torch.compile(two_outputs, backend=backend)(x)
    (a.sum() + b.sum()).backward()
    # Two real outputs (the rest of the forward's outputs are saved for the backward), not a guess.
    assert seen == [2], seen
    assert x.grad is not None

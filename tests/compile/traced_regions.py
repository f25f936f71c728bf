"""The fusion regions of a function, as the backend would cut them: AOTAutograd traces ``fn`` (core ATen
decompositions) into a forward and, when an output requires grad, a backward graph; the partitioner
marks each graph's regions and ``extract_regions`` cuts them out. Shared by the code generators' tests."""

from __future__ import annotations

import torch
from torch._decomp import core_aten_decompositions
from torch._functorch.aot_autograd import aot_function, make_boxed_func

from accelrun.compile.extract import extract_regions
from accelrun.compile.passes.partition_regions import partition
from accelrun.compile.regions import Region


def regions_of(fn, *args, device: str | None = None) -> list[Region]:
    """Regions of ``fn``'s forward and backward graphs; ``args`` moved to ``device`` first when given."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    if device is not None:
        args = tuple(a.detach().to(device).requires_grad_(a.requires_grad) for a in args)
    outs = aot_function(fn, fw_compiler=keep, bw_compiler=keep, decompositions=core_aten_decompositions())(*args)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    if any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs):
        sum(o.float().sum() for o in outs if o.requires_grad).backward()
    regions: list[Region] = []
    for kind, gm in zip(("forward", "backward"), graphs, strict=False):
        partition(gm.graph, first_id=len(regions))
        regions += extract_regions(gm, kind)
    return regions

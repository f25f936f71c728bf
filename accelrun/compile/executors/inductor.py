"""Hand a region to Inductor (``compile_fx_inner``): its own fusion and C++/Triton code generation.

Inductor keeps its own on-disk caches (FX graphs, and generated kernels keyed by their source), so a
region seen before on this machine loads without invoking a C++ compiler; ``compile`` reports the FX
graph cache's hits and misses through ``region.lowering`` when Inductor uses it for the region.
"""

from __future__ import annotations

import torch

from accelrun.compile.executors.base import Executor, RegionFn, register_executor
from accelrun.compile.regions import Region


def materialize(meta: torch.Tensor) -> torch.Tensor:
    """A real tensor with ``meta``'s shape, strides, dtype and device (values arbitrary)."""
    return torch.empty_strided(tuple(meta.shape), tuple(meta.stride()), dtype=meta.dtype, device=meta.device)


def decomposed(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
    """``gm`` retraced through the decompositions Inductor applies before ``compile_fx_inner``: a region
    keeps ops such as ``_softmax`` whole (accelrun's own executors take them so), and Inductor, given one,
    failed with "both a fallback and a decomp for same op" (a new user's mixture of experts)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from accelrun.torch_private import inductor_decompositions

    return make_fx(torch.fx.Interpreter(gm).run, decomposition_table=inductor_decompositions(),
                   tracing_mode="fake")(*inputs)


@register_executor
class InductorExecutor(Executor):
    name = "inductor"

    def decline_reason(self, region: Region) -> str | None:
        if any(not isinstance(m, torch.Tensor) for m in region.input_meta):
            return "a region input is not a tensor (symbolic size)"
        return None

    def compile(self, region: Region, cache_dir: str | None) -> RegionFn:
        from accelrun.torch_private import compile_fx_inner, tracing
        from accelrun.torch_private import dynamo_counters as counters

        before = dict(counters["inductor"])
        inputs = [materialize(m) for m in region.input_meta]
        with tracing(None):  # a fresh context: we may be inside AOTAutograd's
            compiled = compile_fx_inner(decomposed(region.gm, inputs), inputs)
        # Inductor's FX graph cache says hit or miss, or bypasses itself (then: unknown, not counted;
        # its kernel-level code cache still spares the C++ compiler on a repeat).
        delta = {k: counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
        if delta["fxgraph_cache_hit"] or delta["fxgraph_cache_miss"]:
            region.lowering.cache_hit = delta["fxgraph_cache_hit"] > 0

        def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(compiled(list(args)))  # Inductor's calling convention takes a list

        return run

"""Ops whose output's size depends on the data trace the same way with or without the graph cache.

The graph cache traces through torch's precompile path with ``fullgraph=True``, under which Dynamo
captures an op whose output's size depends on the data (``torch.where(mask)``, ``nonzero``, boolean
indexing) as a size read at run time. Everywhere else (``compile.graph_cache = false``, ``compile.dump``,
``compile.debug_numerics``, multi-rank runs, a forward wrapped by activation checkpointing) Dynamo's
default broke the graph there instead. A mixture of experts routed by ``torch.where`` was one graph in
a default run, and in those runs an eager first step, then its experts compiled one by one: the dump a
user read was not of the graphs a default run trains with, and a second rank trained slower than one.

``capturing_data_sized_outputs`` wraps each compiled callable accelrun's backend makes outside the cache
so that Dynamo traces those ops with the cache's setting. Only while accelrun's own compiled calls run: a
user's other ``torch.compile`` calls in the same process, and runs with ``compile.backend = inductor``
(no graph cache to agree with), keep torch's default. Dynamo reads the setting only when it traces, so a
call that finds its graph pays three attribute writes (a few µs). Not matched: ``fullgraph=True`` also
traces ``.item()`` as a number read at run time, which torch's default breaks the graph at; a value
read so and then branched on breaks the cache's trace too (and the cache falls back to this path).

Both paths also trace a checkpointed region (``torch.utils.checkpoint``: transformers'
``gradient_checkpointing_enable()``, ``train.activation_checkpoint``) that changes Python state:
Dynamo refuses that by default ("HOP: Unsafe side effect"), because eager checkpointing replays the
change when the backward recomputes the region. transformers' RMSNorm sets a global through the
`kernels` package on every call, so every checkpointed transformers layer broke the graph and ran
eagerly. With ``SIDE_EFFECTS_ONCE`` the change is made in the forward and not made again in the
recompute: the tensors are the same; only Python state a region changes for itself differs from
eager's (a call counter counts each call once).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from accelrun.torch_private import COMPILED_CALL

# Dynamo's setting (torch 2.6 on) under which a checkpointed region may change Python state (the docstring).
SIDE_EFFECTS_ONCE = "skip_fwd_side_effects_in_bwd_under_checkpoint"


@functools.cache
def side_effects_once() -> dict[str, bool]:
    """``{SIDE_EFFECTS_ONCE: True}`` to set while accelrun traces, or nothing where this torch has no such
    setting: one answer for both trace paths (these wrappers, the graph cache's precompile)."""
    return {SIDE_EFFECTS_ONCE: True} if hasattr(torch._dynamo.config, SIDE_EFFECTS_ONCE) else {}


def capturing_data_sized_outputs(fn: Callable[..., Any], backend: object, fullgraph: bool = False) -> Callable[..., Any]:
    """``fn`` (a ``torch.compile``d callable), traced with data-sized outputs captured where ``backend``
    is accelrun's (an object; Inductor and others are named by a string: ``fn`` as it is). With
    ``fullgraph``, also with host reads captured (``capture_scalar_outputs``), as Dynamo does under
    fullgraph anyway, so that a model's code can tell (``torch_private.traces_host_reads``)."""
    if isinstance(backend, str):
        return fn
    config = torch._dynamo.config
    settings = {"capture_dynamic_output_shape_ops": True, "capture_scalar_outputs": fullgraph, **side_effects_once()}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inlined into a graph Dynamo is tracing: nothing to set
            return fn(*args, **kwargs)
        before = {name: getattr(config, name) for name in settings}
        for name, value in settings.items():
            setattr(config, name, value or before[name])  # (host reads: also where the user asked for them)
        try:
            return fn(*args, **kwargs)
        finally:
            for name, value in before.items():
                setattr(config, name, value)

    return call


def compile_call(module: torch.nn.Module, backend: object, fullgraph: bool) -> None:
    """``module.compile`` (Module.__call__ then reaches ``COMPILED_CALL``), traced as the graph cache traces."""
    module.compile(backend=backend, fullgraph=fullgraph)
    compiled = getattr(module, COMPILED_CALL, None)
    if compiled is not None:
        setattr(module, COMPILED_CALL, capturing_data_sized_outputs(compiled, backend, fullgraph))

"""The garbage collector is paused while accelrun compiles or loads a graph (compile/gc_pause.py)."""

from __future__ import annotations

import gc

import torch

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.gc_pause import gc_paused
from accelrun.compile.options import CompileOptions


def test_paused_nests_and_leaves_the_collector_as_it_was():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is not ended by ours
    finally:
        gc.enable()


def test_the_backend_compiles_with_the_collector_paused(monkeypatch, tmp_path):
    seen = []
    compile_graph = AccelrunBackend._compile_dynamo_graph

    def spy(self, gm, example_inputs):
        seen.append(gc.isenabled())
        return compile_graph(self, gm, example_inputs)

    monkeypatch.setattr(AccelrunBackend, "_compile_dynamo_graph", spy)
    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(executors=["aten"], cache_dir=tmp_path))
    x = torch.randn(4, 8, requires_grad=True)
    torch.compile(lambda t: (t * 2).relu().sum(), backend=backend)(x).backward()
    assert seen == [False] and gc.isenabled()
    torch.testing.assert_close(x.grad, 2.0 * (x > 0))
    torch._dynamo.reset()

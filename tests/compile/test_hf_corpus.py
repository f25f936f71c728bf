"""The compiler on model code nobody here wrote: transformers' causal LMs (tiny random configs, built
locally) and plain-nn models with convolutions, norms and pooling (``corpus_models.py``).

Each case runs one training step (forward, backward) under ``accelrun_backend`` and in eager from the
same weights, and compares the loss, every parameter's gradient and every buffer (batch norm's
running statistics). Tolerances: fp32 elementwise rtol 1e-4, atol 1e-5 (kernels reassociate sums);
bf16 by relative norm ‖compiled − eager‖ ≤ 2e-2 ‖eager‖ (+1e-3 absolute) for every tensor, since a
fused region keeps fp32 between ops where eager rounds each to bf16.

Every case also proves the compiler ran: Dynamo handed it a graph, regions were claimed by the
executor under test, and ``strict`` is on, so any fallback (a pass skipped, a kernel replaced) fails.

The cases are a pairwise covering subset of the matrix (see ``CASES``), to keep the file near two
minutes on two CPU cores; ``bench/corpus_matrix.py`` runs the whole matrix. Triton (interpreter) on a subset.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.codegen import cpp_build
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import resolve_passes
from tests.compile.corpus_models import MODELS, loss_of

FP32, BF16 = torch.float32, torch.bfloat16
pytestmark = pytest.mark.skipif(cpp_build.find_compiler() is None, reason="no g++ on this machine")

# A pairwise covering subset of models × preset × executor × dtype (bench/corpus_matrix.py runs it all):
# every model in the default (default passes, cpp, fp32) and in its opposite (max, aten, bf16), so each
# model meets each level of every factor; three more cases give every pair of factor levels a case.
DEFAULT, OPPOSITE = ("default", "cpp", FP32), ("max", "aten", BF16)
CASES = [
    *[(name, *DEFAULT) for name in MODELS],
    *[(name, *OPPOSITE) for name in MODELS],
    ("mistral", "default", "aten", BF16), ("gpt2", "max", "cpp", BF16), ("convnet", "max", "aten", FP32),
]  # fmt: skip


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus_kernels")


def _step(model, batch):
    loss = loss_of(model, batch)
    loss.backward()
    return loss.detach()


def _cast(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype == FP32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")
        return
    err = (got.float() - want.float()).norm().item()
    bound = 2e-2 * want.float().norm().item() + 1e-3
    assert err <= bound, f"{what}: ‖compiled − eager‖ = {err:.3g} > {bound:.3g}"


def _check_step(name: str, preset: str, executor: str, dtype: torch.dtype, cache_dir) -> AccelrunBackend:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model = model.to(dtype).train()
    batch = _cast(batch, dtype)
    reference = copy.deepcopy(model)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(preset), executors=[executor, "aten"],
                                             cache_dir=cache_dir, strict=True))  # fmt: skip
    loss = _step(torch.compile(model, backend=backend), batch)
    loss_ref = _step(reference, batch)
    _close(loss, loss_ref, dtype, "loss")
    for (pname, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{pname}: a gradient on one side only"
        if p.grad is not None:
            _close(p.grad, q.grad, dtype, f"grad of {pname}")
    for (bname, b), (_, c) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        if b.is_floating_point():
            _close(b, c, dtype, f"buffer {bname}")
        else:
            assert torch.equal(b, c), f"buffer {bname}"
    # The compiler ran: a graph, regions taken by the executor under test, nothing fell back (strict).
    record = backend.record
    assert record.dynamo_graphs >= 1, record.summary()["warnings"]
    assert record.regions, "no fusion region: the case tests nothing of the code generators"
    assert record.regions_per_executor().get(executor, 0) > 0, record.regions_per_executor()
    assert not record.fallbacks
    return backend


def _id(case) -> str:
    name, preset, executor, dtype = case
    return f"{name}-{preset}-{executor}-{str(dtype)[6:]}"


@pytest.mark.parametrize(("name", "preset", "executor", "dtype"), CASES, ids=[_id(c) for c in CASES])
def test_step_matches_eager(name, preset, executor, dtype, cache_dir):
    _check_step(name, preset, executor, dtype, cache_dir)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("name", ["llama", "convnet", "gemma"])  # gemma: GELU's tanh (libdevice)
def test_step_matches_eager_with_triton_interpreted(name, cache_dir, monkeypatch):
    # TRITON_INTERPRET is read when the generated module is imported: set before compiling.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_step(name, "default", "triton", FP32, cache_dir)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_a_kernel_failing_at_its_first_call_does_not_take_the_step_down(tmp_path, monkeypatch):
    """Not strict: conv1d_norms' tanh is ``libdevice.tanh`` in the Triton source, made to raise here (as
    a kernel the device rejects at launch would); such a region raises at its first call and goes to
    aten, with the reason recorded. The step must still match eager."""
    from types import SimpleNamespace

    from accelrun.compile.codegen import triton_libdevice

    def failing_tanh(*args, **kwargs):
        raise RuntimeError("this device cannot run tanh")

    real = triton_libdevice._interpreted
    monkeypatch.setattr(triton_libdevice, "_interpreted", lambda: SimpleNamespace(**{**vars(real()),
                                                                                      "tanh": failing_tanh}))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The generated modules take libdevice when loaded: none may come from another test's cache or import.
    cache_dir = tmp_path
    for loaded in [m for m in sys.modules if m.startswith("accelrun_")]:
        monkeypatch.delitem(sys.modules, loaded)
    torch.manual_seed(0)
    model, batch = MODELS["conv1d_norms"]()
    reference = copy.deepcopy(model)
    backend = AccelrunBackend(CompileOptions(executors=["triton", "aten"], cache_dir=cache_dir))
    _close(_step(torch.compile(model, backend=backend), batch), _step(reference, batch), FP32, "loss")
    for (pname, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        _close(p.grad, q.grad, FP32, f"grad of {pname}")
    record = backend.record
    assert record.fallbacks, "no region raised: the case tests nothing"
    for f in record.fallbacks:
        assert f.stage == "first call" and f.reason and "→ aten" in f.what
        row = next(r for r in record.regions if f.what.startswith(f"region {r.region}:") and r.graph == f.graph)
        assert row.executor == "aten" and "first call" in row.declined["triton"]
    assert record.regions_per_executor().get("triton", 0) > 0  # the other regions stayed compiled

"""One PyTorch OpInfo op through a torch.compile backend, against eager: forward and first-order
gradients of its first sample. Shared by the sampled test (``test_opinfo_sample.py``) and the full
sweep (``bench/opinfo_sweep.py``).

    ops = differentiable_ops(torch.float32)
    outcome = check_op(ops[0], torch.float32, lambda: AccelrunBackend(CompileOptions()))
    outcome.status  # "ok" | "fallback" | "crash" | "mismatch" | "skip"
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

# Stated tolerances: fp32 kernels may reassociate sums (vectorised, threaded); bf16 rounds to 8 bits of
# mantissa, and a compiled region keeps fp32 between ops where eager rounds after each one.
TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


@dataclass
class Outcome:
    name: str  # the OpInfo's name and variant: "linalg.svd", "nn.functional.conv2d"
    # ok | fallback (right numbers, but the compiler fell back somewhere: see record.fallbacks) |
    # crash (the compiler raised) | mismatch (ran, numbers differ) | skip (no case)
    status: str
    detail: str = ""
    regions: int = 0  # fusion regions a code generator (not aten) compiled for the op's graphs


def differentiable_ops(dtype: torch.dtype) -> list[Any]:
    """OpInfos with autograd and ``dtype`` on the CPU, in op_db order (stable across runs)."""
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if op.supports_autograd and dtype in op.supported_dtypes("cpu")]


def op_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _first_sample(op: Any, dtype: torch.dtype) -> Any:
    for sample in op.sample_inputs("cpu", dtype, requires_grad=True):
        return sample
    return None


def _float_outputs(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _run(fn: Callable[..., Any], sample: Any) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs and gradients (of the sum of every float output, weighted to catch mixed-up outputs)
    with respect to every tensor of the sample that requires them."""
    args = (sample.input, *sample.args)
    out = fn(*args, **sample.kwargs)
    outs = _float_outputs(out)
    leaves = [t for t in tree_flatten((args, sample.kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    grads: list[torch.Tensor | None] = []
    diff = [o for o in outs if o.requires_grad]
    if diff and leaves:
        total = sum(((o.float() * (k + 1)).sum() for k, o in enumerate(diff)), torch.zeros(()))
        grads = list(torch.autograd.grad(total, leaves, allow_unused=True))
    return [o.detach() for o in outs], grads


def _fresh(sample: Any) -> Any:
    """The same sample with its own leaf tensors (the compiled and the eager run each get one)."""

    def copy(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().clone().requires_grad_(t.requires_grad)
        return t

    from torch.utils._pytree import tree_map

    sample = type(sample)(tree_map(copy, sample.input), args=tree_map(copy, sample.args),
                          kwargs=tree_map(copy, sample.kwargs))  # fmt: skip
    return sample


def _crash_line(e: BaseException) -> str:
    """The exception's own line: a backend error wraps the compiler's as "... raised:\nTypeError: ..."."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    for i, ln in enumerate(lines[:-1]):
        if ln.rstrip().endswith("raised:"):
            return lines[i + 1][:300]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def check_op(op: Any, dtype: torch.dtype, backend: Callable[[], Any]) -> Outcome:
    """Compile the op with ``backend()`` (a fresh backend per op) and compare with eager."""
    name = op_name(op)
    sample = _first_sample(op, dtype)
    if sample is None:
        return Outcome(name, "skip", "no sample input")
    torch._dynamo.reset()
    try:
        expected = _run(op.op, _fresh(sample))
    except Exception as e:  # eager itself refuses this sample (a sample meant for another device)
        return Outcome(name, "skip", f"eager raised {type(e).__name__}")
    made = backend()
    compiled = torch.compile(op.op, backend=made, dynamic=False)
    try:
        got = _run(compiled, _fresh(sample))
    except Exception as e:
        return Outcome(name, "crash", _crash_line(e))
    finally:
        torch._dynamo.reset()
    try:
        for a, b in zip(got[0] + got[1], expected[0] + expected[1], strict=True):
            if a is None or b is None:
                if (a is None) != (b is None):
                    raise AssertionError("a gradient is missing on one side")
                continue
            torch.testing.assert_close(a, b, equal_nan=True, **TOLERANCES.get(dtype, {}))
    except (AssertionError, ValueError) as e:
        return Outcome(name, "mismatch", str(e).strip().splitlines()[0][:300])
    record = getattr(made, "record", None)
    regions = sum(1 for r in record.regions if r.executor != "aten") if record is not None else 0
    if record is not None and record.fallbacks:  # right numbers, but part of the compiler gave up
        return Outcome(name, "fallback", record.fallbacks[0].line()[:300], regions)
    return Outcome(name, "ok", regions=regions)


def accelrun(executors: list[str] | None = None, passes: str = "default",
             cache_dir: str | None = None, strict: bool = False) -> Callable[[], Any]:  # fmt: skip
    """A factory of accelrun backends; kernels cached in ``cache_dir``, else ACCELRUN_CACHE_DIR, else a
    throwaway folder."""
    from pathlib import Path

    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.compile.passes.base import resolve_passes

    root = cache_dir or os.environ.get("ACCELRUN_CACHE_DIR") or tempfile.mkdtemp(prefix="accelrun-opinfo-")
    cache = Path(root) / "compile"

    def make() -> Any:
        return AccelrunBackend(CompileOptions(passes=resolve_passes(passes), executors=executors or ["cpp", "aten"],
                                              cache_dir=cache, strict=strict))  # fmt: skip

    return make

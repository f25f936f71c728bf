"""A seeded sample of PyTorch's OpInfo database through accelrun_backend (default passes, cpp then
aten), forward and first-order gradients against eager (tolerances: ``opinfo_check.TOLERANCES``,
fp32 rtol/atol 1e-4, bf16 3e-2). The whole sweep is ``bench/opinfo_sweep.py``.

The sample changes only with SEED; ops that once crashed the compiler are always in it.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

pytest.importorskip("expecttest", reason="torch.testing._internal (the OpInfo database) imports expecttest")

from tests.compile.opinfo_check import accelrun, check_op, differentiable_ops, op_name  # noqa: E402

SEED = 16
SAMPLED = {torch.float32: 12, torch.bfloat16: 6}
# Crashed the compiler once: a zero-size matrix (index arithmetic divided by an axis of 0) and a
# reduction over dim 0 of a 0-dim tensor.
REGRESSIONS = ["svd", "linalg.svd", "logdet", "linalg.slogdet", "logsumexp"]


@functools.cache
def _sampled(dtype: torch.dtype) -> list:
    """The seeded sample, resolved when a test runs: importing the OpInfo database takes ~8 s, which
    collecting tests/compile should not pay."""
    ops = differentiable_ops(dtype)
    return [ops[i] for i in sorted(random.Random(SEED).sample(range(len(ops)), SAMPLED[dtype]))]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return accelrun(["cpp", "aten"], "default", str(tmp_path_factory.mktemp("opinfo_cache")))


def _check(op, dtype, backend) -> None:
    outcome = check_op(op, dtype, backend)
    if outcome.status == "skip":
        pytest.skip(f"{outcome.name}: {outcome.detail}")
    assert outcome.status == "ok", f"{outcome.name} {outcome.status}: {outcome.detail}"


@pytest.mark.parametrize(("dtype", "k"), [(d, k) for d, n in SAMPLED.items() for k in range(n)],
                         ids=lambda v: str(v)[6:] if isinstance(v, torch.dtype) else f"sample{v}")  # fmt: skip
def test_sampled_op_matches_eager(dtype, k, backend):
    _check(_sampled(dtype)[k], dtype, backend)


@pytest.mark.parametrize("name", REGRESSIONS)
def test_op_that_once_crashed_matches_eager(name, backend):
    (op,) = [o for o in differentiable_ops(torch.float32) if op_name(o) == name]
    _check(op, torch.float32, backend)

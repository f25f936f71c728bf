"""A seeded sample of PyTorch's OpInfo database through accelrun_backend (default passes, cpp then
aten), forward and first-order gradients against eager (tolerances: ``opinfo_check.TOLERANCES``,
fp32 rtol/atol 1e-4, bf16 3e-2). The whole sweep is ``bench/opinfo_sweep.py``.

The sample changes only with SEED; ops that once crashed the compiler are always in it.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("expecttest", reason="torch.testing._internal (the OpInfo database) imports expecttest")

from tests.compile.opinfo_check import accelrun, check_op, differentiable_ops, op_name  # noqa: E402

SEED = 16
SAMPLED = {torch.float32: 6, torch.bfloat16: 3}
# Crashed the compiler once: a zero-size matrix (index arithmetic divided by an axis of 0) and a
# reduction over dim 0 of a 0-dim tensor.
REGRESSIONS = ["svd", "linalg.svd", "logdet", "linalg.slogdet", "logsumexp"]


def _cases() -> list:
    cases = []
    for dtype, n in SAMPLED.items():
        ops = differentiable_ops(dtype)
        names = [op_name(o) for o in ops]
        picked = set(random.Random(SEED).sample(range(len(ops)), n))
        picked |= {names.index(r) for r in REGRESSIONS if r in names and dtype == torch.float32}
        cases += [pytest.param(ops[i], dtype, id=f"{names[i]}-{str(dtype)[6:]}") for i in sorted(picked)]
    return cases


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return accelrun(["cpp", "aten"], "default", str(tmp_path_factory.mktemp("opinfo_cache")))


@pytest.mark.parametrize(("op", "dtype"), _cases())
def test_opinfo_op_matches_eager(op, dtype, backend):
    outcome = check_op(op, dtype, backend)
    if outcome.status == "skip":
        pytest.skip(f"{outcome.name}: {outcome.detail}")
    assert outcome.status == "ok", f"{outcome.name} {outcome.status}: {outcome.detail}"

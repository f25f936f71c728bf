"""A warm start loads lowered kernels and their tuned launches: a second process with the same model
and cache lowers nothing and times nothing (issue 31, item 5). Two processes run
``warm_start_counts.py``: one training step of the tiny Llama through the Triton executor (Triton's
interpreter), the graph cache and launch tuning with a fake timer; each reports its calls."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run(cache, env):
    done = subprocess.run([sys.executable, "-m", "tests.compile.warm_start_counts"], capture_output=True, text=True,
                          env={**env, "ACCELRUN_CACHE_DIR": str(cache)}, cwd=REPO, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_neither_lowers_nor_tunes(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cold = run(tmp_path, env)
    assert cold["regions"].get("triton", 0) > 0, cold  # the step ran Triton kernels
    assert cold["triton_compiles"] > 0 and cold["lower_regions"] > 0
    assert cold["tune"] > 0 and cold["timed"] > 0 and cold["graphs_loaded"] == 0
    assert any((tmp_path / "compile").rglob("launches/*.json"))  # tuned launches written beside the binaries
    warm = run(tmp_path, env)
    assert warm["graphs_loaded"] == 2, warm  # the blocks' graph and the loss head's, lowered
    assert warm["lower_regions"] == 0 and warm["triton_compiles"] == 0, warm
    assert cold["partitioner_imported"] and not warm["partitioner_imported"]
    assert warm["tune"] == 0 and warm["timers"] == 0 and warm["timed"] == 0, warm
    assert warm["cache_hits"] > 0  # the tuned launches were read back, not the defaults used
    assert warm["loss"] == pytest.approx(cold["loss"], rel=1e-6)
    assert warm["grad_sum"] == pytest.approx(cold["grad_sum"], rel=1e-5)

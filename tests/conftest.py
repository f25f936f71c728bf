"""Shared fixtures: a tiny, fast version of the default recipe, and an isolated runs directory."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "configs" / "llama.yaml"

# The default recipe, shrunk so that a step takes a few milliseconds on a CPU. On the CPU (gloo for
# several ranks) even on a host with GPUs: the numbers compared with one process, the thread and
# memory checks and the rank counts (2 and 4 ranks on one GPU would be refused) all mean a CPU.
TINY = [
    "train.device=cpu",
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
    "model.vocab_size=320", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=4",
    "train.lr_schedule.warmup_steps=2", "train.optimizer.lr=0.01", "data.max_bytes=400000",
    "report.warmup_steps=1", "report.progress=none",
    # The default recipe compiles with accelrun; tests of the loop, layouts and reports run eager (a
    # compile per test would cost seconds each). Tests of the compiled default override this back.
    "compile.backend=eager",
]


def pytest_configure(config: pytest.Config) -> None:
    """What the autouse fixture sets per test, set for the whole process (each xdist worker's), so that
    module-scoped fixtures, which run outside it, and the processes tests start (a worker's fork server
    keeps the environment of its first launch) see it too: torch's default threads, not what a look at
    the machine's load picks (train/threads.py; a compare test's twin runs once took 2 and 1 threads
    beside the other worker), no peak probe, and a cache of the worker's own, never the user's."""
    os.environ["ACCELRUN_FIXED_THREADS"] = "1"
    os.environ["ACCELRUN_NO_PEAK_PROBE"] = "1"
    os.environ["ACCELRUN_CACHE_DIR"] = config._accelrun_cache = tempfile.mkdtemp(prefix="accelrun-tests-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(getattr(config, "_accelrun_cache", ""), ignore_errors=True)  # its g++ libraries and graphs


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core, from 2 (on 2 cores one worker left the CPU idle half the time:
    26 min against 21 on two) to 4 (each worker's multi-rank tests start ranks of their own)."""
    return min(max(os.cpu_count() or 1, 2), 4)


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own cache (pytest_configure sets the rest for the whole process)."""
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def tiny(tmp_path: Path):
    """tiny(steps, *more_overrides) -> the override list for a tiny run writing under tmp_path/runs."""

    def _tiny(steps: int, *more: str) -> list[str]:
        return [*TINY, f"train.steps={steps}", f"report.runs_dir={tmp_path / 'runs'}", *more]

    return _tiny

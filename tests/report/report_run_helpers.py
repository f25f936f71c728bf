"""Short real runs shared by the report tests of one module (trained once per module, in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import DEFAULT_CONFIG, TINY


def train_tiny(runs_dir: Path, steps: int, *more: str) -> Path:
    from accelrun.config import load_config
    from accelrun.train.entry import train

    overrides = [*TINY, f"train.steps={steps}", f"report.runs_dir={runs_dir}", "checkpoint.enabled=false",
                 "checkpoint.resume=none", *more]
    with pytest.MonkeyPatch.context() as mp:  # module-scoped callers run outside the autouse fixture
        mp.setenv("ACCELRUN_NO_PEAK_PROBE", "1")
        mp.setenv("ACCELRUN_CACHE_DIR", str(runs_dir / "cache"))
        return train(load_config(DEFAULT_CONFIG, overrides), command="test").run_dir

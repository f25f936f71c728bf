"""Fixtures shared by the multi-process tests: one-process reference runs, trained once per session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.dist.jobs import losses, train_job


@dataclass(frozen=True)
class Reference:
    run_dir: Path
    losses: list[float]

    def checkpoint(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step-{step:06d}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(steps, *overrides) -> the one-process run of the tiny recipe (micro-batch 4 = the global
    batch), checkpointed every 2 steps and all checkpoints kept; trained once per argument list."""
    runs = tmp_path_factory.mktemp("reference")
    made: dict[tuple, Reference] = {}

    def get(steps: int, *overrides: str) -> Reference:
        key = (steps, *overrides)
        if key not in made:
            name = f"one-{len(made)}"
            r = train_job(runs, steps, "checkpoint.every=2", "checkpoint.keep=100", f"name={name}", *overrides)
            made[key] = Reference(r.run_dir, losses(r.run_dir))
        return made[key]

    return get

"""The Gemma family (Gemma 1: 2B, 7B): (1 + weight) RMSNorm, embeddings scaled by sqrt(dim), GeGLU,
its own head dimension, tied embeddings. The module itself is ``accelrun.models.families.gemma.model``."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # SPEC imports torch; the planner imports this folder's torch-free ``shape`` module without it.
    if name == "SPEC":
        from accelrun.models.families.gemma.spec import SPEC

        return SPEC
    raise AttributeError(name)

"""The Llama family: Llama 2/3/3.1 (rope scaling), Mistral (within its sliding window), Qwen2 (q/k/v
biases), tied or untied embeddings. The module itself is ``accelrun.models.families.llama.model``."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # SPEC imports torch; the planner imports this folder's torch-free ``shape`` module without it.
    if name == "SPEC":
        from accelrun.models.families.llama.spec import SPEC

        return SPEC
    raise AttributeError(name)

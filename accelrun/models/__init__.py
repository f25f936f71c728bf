"""Model definitions: the model families (``accelrun.models.families``, each with its FLOP and
parameter counts), and user models by import path.

Named sizes are recipe files (``recipes/model/*.yaml``), not code. ``import accelrun.models`` imports
nothing heavy: the names below load (with torch) on first use, so that torch-free code (the planner
asking a family's ``shape`` module) can import from this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelBuildError": "build", "build_model": "build", "model_flops_per_token": "build",
    "model_summary": "build", "transformer_blocks": "build",
    "Llama": "families.llama.model", "LlamaArgs": "families.llama.model", "RMSNorm": "families.llama.model",
    "TransformerBlock": "families.llama.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)

"""The MoE family: Mixtral / Qwen-MoE / DeepSeek-style routed experts (token-choice top-k, optional
shared expert, load-balancing loss) on Llama's attention. The module itself is
``accelrun.models.families.moe.model``; expert parallelism is ``accelrun.dist.expert_parallel``.

Tensor, pipeline and context parallelism are not supported for this family yet (validation refuses
them: ``accelrun.config.moe_checks``).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # SPEC imports torch; the planner imports this folder's torch-free ``shape`` module without it.
    if name == "SPEC":
        from accelrun.models.families.moe.spec import SPEC

        return SPEC
    raise AttributeError(name)

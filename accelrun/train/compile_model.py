"""Apply the recipe's compile settings to a model (torch.compile with the chosen backend)."""

from __future__ import annotations

from torch import nn

from accelrun.config.schema import CompileConfig


def compile_model(model: nn.Module, blocks: nn.ModuleList | None, cfg: CompileConfig) -> str:
    """Compile in place (``Module.compile`` keeps parameter names); returns what was compiled."""
    if cfg.backend == "eager":
        return "nothing (eager)"
    if cfg.scope == "block" and blocks is not None:
        # Identical blocks share one compiled graph: Dynamo's cache is keyed by code, not instance.
        for block in blocks:
            block.compile(backend=cfg.backend, fullgraph=cfg.fullgraph)
        return f"{len(blocks)} transformer blocks with {cfg.backend}"
    model.compile(backend=cfg.backend, fullgraph=cfg.fullgraph)
    if cfg.scope == "block":
        return f"the whole model with {cfg.backend} (compile.scope = block, but it has no `layers` block list)"
    return f"the whole model with {cfg.backend}"

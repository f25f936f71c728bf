"""Apply the recipe's compile settings to a model: torch.compile with Inductor or accelrun's backend."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from accelrun.config.schema import CompileConfig


@dataclass
class Compiled:
    description: str  # what was compiled, for the run's log and report
    record: object | None = None  # accelrun's CompileRecord (None for eager and inductor)
    backend: object | None = None


def compile_model(model: nn.Module, blocks: list[nn.Module] | None, cfg: CompileConfig,
                  dump_dir: Path | None = None) -> Compiled:  # fmt: skip
    """Compile in place (``Module.compile`` keeps parameter names)."""
    if cfg.backend == "eager":
        return Compiled("nothing (eager)")
    backend: object = cfg.backend
    record = None
    if cfg.backend == "accelrun":
        from accelrun.compile.backend import AccelrunBackend
        from accelrun.compile.options import CompileOptions

        backend = AccelrunBackend(CompileOptions.from_config(cfg, dump_dir=dump_dir if cfg.dump else None))
        record = backend.record
    name = cfg.backend
    if cfg.scope in ("block", "loss") and blocks is not None:
        what = f"{len(blocks)} transformer blocks with {name}"
        head = getattr(model, "head_loss", None) if cfg.scope == "loss" else None
        if cfg.scope == "loss" and (head is None or not _has_head(model)):
            what += " (compile.scope = loss, but this model or stage computes no loss head)"
            head = None
        elif head is not None:
            what += " + the output head and loss as one graph"
        targets = [(b, "forward") for b in blocks] + ([(model, "head_loss")] if head is not None else [])
        cache = _graph_cache(cfg, backend, targets)
        if cache is not None:
            from accelrun.compile.graph_cache import install

            install(cache, list(blocks), "forward")
            if head is not None:
                install(cache, [model], "head_loss")
            return Compiled(what, record, backend)
        # Identical blocks share one compiled graph: Dynamo's cache is keyed by code, not instance.
        for block in blocks:
            block.compile(backend=backend, fullgraph=cfg.fullgraph)
        if head is not None:
            import torch

            # An instance attribute shadows the method, so forward() calls the compiled head.
            model.head_loss = torch.compile(head, backend=backend, fullgraph=cfg.fullgraph)
        return Compiled(what, record, backend)
    if blocks is None and cfg.scope in ("block", "loss") and (found := repeated_blocks(model)) is not None:
        # A user's model without a `layers` list: compiling its forward whole would let one
        # data-dependent branch (a router) make Dynamo skip the frame, and nothing would be compiled.
        # Its repeated blocks compile on their own; the code between them runs eagerly.
        path, found_blocks = found
        for block in found_blocks:
            block.compile(backend=backend, fullgraph=cfg.fullgraph)
        return Compiled(f"{len(found_blocks)} repeated {type(found_blocks[0]).__name__} blocks ({path}) with {name} "
                        f"(no `layers` list: compile.scope = {cfg.scope} found them)", record, backend)  # fmt: skip
    if cfg.scope == "model" and (cache := _graph_cache(cfg, backend, [(model, "forward")])) is not None:
        from accelrun.compile.graph_cache import install

        install(cache, [model], "forward")
        return Compiled(f"the whole model and its loss with {name}", record, backend)
    model.compile(backend=backend, fullgraph=cfg.fullgraph)
    if cfg.scope != "model":
        return Compiled(f"the whole model with {name} (compile.scope = {cfg.scope}, but it has no `layers` "
                        "block list)", record, backend)  # fmt: skip
    return Compiled(f"the whole model and its loss with {name}", record, backend)


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """(path, blocks): the outermost ``ModuleList`` of at least two modules all of one class (a custom
    model's layers under another name; the experts inside a layer are deeper, so not taken), or None."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            depth = path.count(".")
            if best is None or depth < best[0]:
                best = (depth, path, list(module))
    return (best[1], best[2]) if best is not None else None


def _graph_cache(cfg: CompileConfig, backend: object, targets: list[tuple[nn.Module, str]]):
    """accelrun's cross-process graph cache for these modules, or None (the reason goes in the record)."""
    if cfg.backend != "accelrun":
        return None
    from accelrun.compile.graph_cache import GraphCache, decline_reason

    why = decline_reason(cfg, targets)
    if why is not None:
        backend.record.graph_cache = {"off": why}  # type: ignore[attr-defined]
        return None
    return GraphCache(backend, backend.options.cache_dir / "graphs")  # type: ignore[attr-defined]


def _has_head(model) -> bool:
    """Whether this model or pipeline stage ends in its output layer (a family's model says so with
    ``has_head``; otherwise an ``output`` layer that a stage without the head sets to None)."""
    has = getattr(model, "has_head", None)
    return bool(has) if has is not None else getattr(model, "output", None) is not None

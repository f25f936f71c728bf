"""The compiler's settings, resolved from a recipe's ``compile`` section (or built directly)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelrun.compile.passes.base import ConfiguredPass, resolve_passes


def default_cache_dir() -> Path:
    root = os.environ.get("ACCELRUN_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "accelrun") / "compile"


@dataclass
class CompileOptions:
    passes: list[ConfiguredPass] = field(default_factory=lambda: resolve_passes("default"))
    executors: list[str] = field(default_factory=lambda: ["cpp", "triton", "aten"])
    cache_dir: Path = field(default_factory=default_cache_dir)
    debug_numerics: bool = False
    dump_dir: Path | None = None  # write every pass's graphs here (explain always sets it)
    # Fallbacks (a pass that raised skipped for its graph, a region sent to the next executor) become
    # errors: for developers of the compiler, and tests that must see the compiler itself work.
    strict: bool = False
    # Triton kernels' launch configurations timed on the GPU at their first call and cached beside them.
    tune_launches: bool = True

    @classmethod
    def from_config(cls, cfg: Any, dump_dir: Path | None = None) -> CompileOptions:
        """From a ``CompileConfig`` (the recipe's compile section)."""
        return cls(
            passes=resolve_passes(cfg.passes),
            executors=list(cfg.executors),
            cache_dir=Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir(),
            debug_numerics=cfg.debug_numerics,
            dump_dir=dump_dir,
            strict=bool(getattr(cfg, "strict", False)),  # compile.strict, where the schema has it
            tune_launches=bool(getattr(cfg, "tune_launches", True)),
        )

    def fingerprint(self) -> str:
        """What about the options changes compiled output (for cache keys)."""
        passes = ";".join(f"{p.name}{p.options.model_dump_json()}" for p in self.passes)
        # tune_launches: a saved Triton region keeps whether it tunes (read at its first call)
        return f"passes={passes}|executors={','.join(self.executors)}|tune_launches={self.tune_launches}"

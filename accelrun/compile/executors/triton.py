"""accelrun's own Triton code generation for fusion regions (see ``compile/codegen/triton.py``).

Runs on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (slow; for tests).
"""

from __future__ import annotations

import importlib.util
import os

from accelrun.compile.codegen.loop_ir import Unsupported, cached_program
from accelrun.compile.executors.base import Executor, RegionFn, register_executor
from accelrun.compile.regions import Region


@register_executor
class TritonExecutor(Executor):
    name = "triton"

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device (set TRITON_INTERPRET=1 to run Triton kernels on the CPU, slowly)"
        return None

    def decline_reason(self, region: Region) -> str | None:
        if os.environ.get("TRITON_INTERPRET") != "1":
            devices = {m.device.type for m in (*region.input_meta, *region.output_meta) if hasattr(m, "device")}
            if devices - {"cuda"}:
                return f"tensors on {', '.join(sorted(devices - {'cuda'}))}: Triton kernels run on CUDA tensors"
        try:
            self._source(region)
        except Unsupported as e:
            return str(e)
        return None

    def compile(self, region: Region, cache_dir: str | None) -> RegionFn:
        from accelrun.compile.codegen.triton import TritonRegion, load_module, module_path

        source = self._source(region)
        # A hit: the module is on disk from an earlier run, and Triton's own cache (TRITON_CACHE_DIR,
        # ~/.triton/cache by default) holds its kernels' binaries, keyed by the same source.
        region.facts["cache_hit"] = module_path(source, cache_dir).exists()
        return TritonRegion(cached_program(region), load_module(source, cache_dir))

    @staticmethod
    def _source(region: Region) -> str:
        from accelrun.compile.codegen.triton import triton_source

        if "triton_source" not in region.facts:
            region.facts["triton_source"] = triton_source(cached_program(region))
        region.facts["source"], region.facts["source_ext"] = region.facts["triton_source"], "py"
        return region.facts["triton_source"]

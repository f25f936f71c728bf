"""accelrun's own Triton code generation for fusion regions (see ``compile/codegen/triton.py``).

Runs on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1`` (slow; for tests).
"""

from __future__ import annotations

import importlib.util
import os

from accelrun.compile.codegen.loop_ir import cached_program
from accelrun.compile.executors.base import RegionFn, register_executor
from accelrun.compile.executors.generated import GeneratedCodeExecutor
from accelrun.compile.regions import Region


@register_executor
class TritonExecutor(GeneratedCodeExecutor):
    name = "triton"
    device_type = "cuda"
    source_ext = "py"
    runtime_rows = True  # a row count read at each call (codegen.runtime_rows; triton_rows_region)
    tune_launches = True  # compile.tune_launches (the backend sets it from its options)

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"  # (TRITON_INTERPRET=1 runs its kernels on the CPU, slowly: for tests, not for speed)
        return None

    def runs_anywhere(self) -> bool:
        return os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter runs kernels on CPU tensors

    def compile(self, region: Region, cache_dir: str | None) -> RegionFn:
        from accelrun.compile.codegen.triton import load_module, module_path
        from accelrun.compile.codegen.triton_region import TritonRegion

        source = self.source(region)
        # A hit: the module is on disk from an earlier run, and Triton's own cache (TRITON_CACHE_DIR,
        # ~/.triton/cache by default) holds its kernels' binaries, keyed by the same source.
        if region.lowering.cache_hit is None:  # (build_ahead found out first, before writing the module)
            region.lowering.cache_hit = module_path(source, cache_dir).exists()
        program = cached_program(region)
        module = load_module(source, cache_dir)
        if program.runtime_rows is not None:  # compiled at its first calls, for the counts' specialisations
            from accelrun.compile.codegen.triton_rows_region import TritonRowsRegion

            return TritonRowsRegion(program, module)
        if os.environ.get("TRITON_INTERPRET") == "1":  # nothing to time here (launch_tuning.can_time: False)
            tune = self.tune_launches and _can_time()
            return with_output_strides(TritonRegion(program, module, tune=tune), program)
        # Triton compiles a kernel at its first call, inside the first training step. Compiled (and
        # loaded) here instead, a kernel the real compiler rejects, or one needing more registers or
        # shared memory than the device has, is a compile failure the lowering records and hands to the
        # next executor, and the first step's time holds no Triton compiles. (What still fails at the
        # first call, the lowering's FirstCallCheck catches.)
        from accelrun.compile.codegen.triton_aot import warm_up

        warm_up(program, module, self._cached_plan(program, module))  # built and loaded now, not at step 1
        return with_output_strides(TritonRegion(program, module, tune=self.tune_launches), program)

    def build_ahead(self, regions: list[Region], cache_dir: str | None) -> None:
        """Every claimed region's kernels compiled side by side now (``triton_aot.build_ahead``): the
        lowering then warms each region up in turn and finds its kernels built."""
        if os.environ.get("TRITON_INTERPRET") == "1":
            return  # the interpreter compiles nothing
        from accelrun.compile.codegen.triton import load_module, module_path
        from accelrun.compile.codegen.triton_aot import build_ahead

        programs = []
        for region in regions:
            try:  # a region that fails here fails again in its own compile, which says why
                source = self.source(region)
                region.lowering.cache_hit = module_path(source, cache_dir).exists()  # before it is written
                program, module = cached_program(region), load_module(source, cache_dir)
                if program.runtime_rows is not None:  # built at its first calls (TritonRowsRegion)
                    continue
                programs.append((program, module, self._cached_plan(program, module)))
            except Exception:  # noqa: BLE001
                continue
        build_ahead(programs)

    def _cached_plan(self, program, module) -> list | None:
        """The launches tuned before for this device (this process or another), which are the ones to
        build; None: the generator's defaults."""
        return _cached_launches(program, module.__file__) if self.tune_launches and _can_time() else None

    def generate(self, program) -> str:
        from accelrun.compile.codegen.triton import triton_source

        return triton_source(program)


def _can_time() -> bool:
    from accelrun.compile.codegen.launch_tuning import can_time

    return can_time()


def _cached_launches(program, module_file: str):
    from accelrun.compile.codegen.launch_tuning import cached_launches

    return cached_launches(program, module_file)


def with_output_strides(fn: RegionFn, program) -> RegionFn:
    """``fn`` whose outputs carry the strides the kernels wrote them with.

    The loop program stores an output at its buffer's strides (eager's layout of the node: a
    permuted but dense one, see ``loop_ir.output_strides``). A region call that allocates its outputs
    contiguous holds exactly those elements in its storage, so viewing that storage with the
    buffer's strides is the output, at no copy."""
    from accelrun.compile.codegen.loop_ir import contiguous_strides

    outs = program.of_role("output")
    restride = [(k, b.shape, b.stride) for k, b in enumerate(outs) if b.stride != contiguous_strides(b.shape)]
    return _Restrided(fn, restride) if restride else fn


class _Restrided:
    def __init__(self, fn: RegionFn, restride: list) -> None:
        self.fn, self.restride = fn, restride

    def __call__(self, *args):
        result = list(self.fn(*args))
        for k, shape, stride in self.restride:
            if result[k].stride() != stride:
                result[k] = result[k].as_strided(shape, stride)
        return tuple(result)

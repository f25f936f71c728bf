"""Running a generated Triton module: ``TritonRegion`` launches a ``LoopProgram``'s kernels.

Apart from ``triton.py`` (which writes the module and plans its launches) and ``triton_aot.py``
(which compiles the kernels ahead of the first call), because running needs both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from accelrun.compile.codegen.cached_files import found
from accelrun.compile.codegen.loop_ir import Buffer, LoopProgram
from accelrun.compile.codegen.triton import Launch, launches, load_module, scratch_buffers
from accelrun.compile.codegen.triton_aot import kernel_binaries_beside, warm_up
from accelrun.torch_private import cuda_current_raw_stream, triton_direct_launch


class TritonRegion:
    """Allocates outputs on the inputs' device and launches the kernels in order.

    Everything a call needs that does not depend on the tensors is worked out here, once: the inputs'
    expected layouts, the outputs' shapes, each launch's grid and argument slots. Temporaries and
    partial sums live in scratch tensors allocated once per CUDA stream (kernels on one stream run in
    order, so a call's scratch is free again when the next call's kernels start). On a GPU the first
    call launches through ``triton.jit`` (compiling, or loading from Triton's cache); later calls go
    straight to the compiled kernels' launchers, skipping the JIT's argument binding and cache lookup.
    """

    fresh_outputs = True  # every output is a new tensor (read by fast_calls)

    def __init__(self, program: LoopProgram, module: Any, tune: bool = False) -> None:
        self.program, self.module_file = program, str(Path(module.__file__).resolve())
        self.module, self.launch = module, module.launch
        # compile.tune_launches: at the first call on a GPU, launch configurations from the tuning cache
        # beside the binaries, or timed there and then (launch_tuning); "cache" / "tuned" once done.
        self.tune = tune
        self.tuning: str | None = None
        self.inputs = program.of_role("input")
        self.outputs = program.of_role("output")
        self.temps = program.of_role("temp")
        scratch = scratch_buffers(program)
        self._in_specs = [(tuple(b.shape), tuple(b.stride), b.dtype) for b in self.inputs]
        self._out_specs = [(tuple(b.shape), b.dtype) for b in self.outputs]
        self._scratch_specs = [(tuple(b.shape), b.dtype) for b in self.temps]
        self._scratch_specs += [(s.shape, s.dtype) for s in scratch]
        slot = {n: i for i, n in enumerate([b.name for b in program.buffers] + [s.name for s in scratch])}
        self._slot = slot
        self._plan = self._plan_of(launches(program))
        self._scratch: dict[Any, list[torch.Tensor]] = {}
        self._compiled: list[tuple[Any, ...]] | None = None
        # ACCELRUN_TRITON_DIRECT=0 keeps every launch on triton.jit's path (to compare, or to debug).
        env = os.environ
        self._direct = env.get("TRITON_INTERPRET") != "1" and env.get("ACCELRUN_TRITON_DIRECT") != "0"

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(args) != len(self.inputs):
            raise TypeError(f"compiled region takes {len(self.inputs)} inputs, got {len(args)}")
        ins = args
        for t, (shape, stride, dtype) in zip(args, self._in_specs, strict=True):
            if t.dtype != dtype or t.shape != shape or t.stride() != stride:
                ins = tuple(_conform(t, b) for t, b in zip(args, self.inputs, strict=True))
                break
        device = args[0].device if args else torch.device("cuda" if self._direct else "cpu")
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self._out_specs]
        if device.type != "cuda":  # Triton's interpreter; the launches as planned (tuned, in tests)
            scratch = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self._scratch_specs]
            bufs = (*ins, *outs, *scratch)
            if self.tune and self.tuning is None:
                self._tune(bufs)
            for kernel, grid_, slots, _, options in self._plan:
                kernel[grid_](*[bufs[i] for i in slots], **options)
            return tuple(outs)
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = cuda_current_raw_stream(index)
        scratch = self._scratch.get((index, stream))
        if scratch is None:
            scratch = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self._scratch_specs]
            self._scratch[index, stream] = scratch
        bufs = (*ins, *outs, *scratch)
        compiled = self._compiled
        if compiled is not None:
            # What triton.jit's launch passes, without its argument binding and cache lookup.
            enter, leave = _launch_hooks()
            for ck, run, function, metadata, grid_, slots, consts in compiled:
                kargs = [bufs[i] for i in slots]
                meta = ck.launch_metadata(grid_, stream, *kargs, *consts) if enter is not None else None
                g0, g1, g2 = grid_
                run(g0, g1, g2, stream, function, metadata, meta, enter, leave, *kargs, *consts)
            return tuple(outs)
        found = []
        with kernel_binaries_beside(self.module_file):  # a call the warm-up did not foresee compiles here
            if self.tune and self.tuning is None:
                self._tune(bufs)
            for kernel, grid_, slots, _, options in self._plan:
                ck = kernel[grid_](*[bufs[i] for i in slots], **options)
                found.append(ck)
        direct = [triton_direct_launch(ck) for ck in found]
        if self._direct and all(d is not None for d in direct):
            self._compiled = [(ck, *d, p[1], p[2], p[3]) for ck, d, p in zip(found, direct, self._plan, strict=True)]
        return tuple(outs)

    def _plan_of(self, plan: list[Launch]) -> list[tuple[Any, ...]]:
        """Per launch: (kernel, 3-d grid, buffer slots, constexprs, launch keywords)."""
        return [(getattr(self.module, ln.kernel), (*ln.grid, 1, 1)[:3], tuple(self._slot[a] for a in ln.args),
                 (ln.block_r, ln.block_n), ln.options()) for ln in plan]  # fmt: skip

    def _tune(self, bufs: tuple[torch.Tensor, ...]) -> None:
        from accelrun.compile.codegen.launch_tuning import (
            CudaEventTimer,
            current_device_key,
            tuned_launches,
        )

        slots = [p[2] for p in self._plan]
        chosen = tuned_launches(self.program, self.module_file, current_device_key(),
                                lambda: CudaEventTimer(self.module, list(bufs), slots, self.program))  # fmt: skip
        self._plan, self.tuning = self._plan_of(chosen.launches), chosen.source

    def __reduce__(self) -> tuple:
        # Saved in the graph cache, as a CppRegion is: the generated module is imported again from its
        # file (Triton's own cache holds its kernels' binaries), the launches planned from the program.
        # Without this a graph of Triton regions could only be saved unlowered, and a new process
        # lowered every region again (a 12 s first step on an H100 against Inductor's 3 s).
        return (_restore_triton_region, (self.module_file, self.program, self.tune))


def _restore_triton_region(module_file: str, program: LoopProgram, tune: bool = False) -> TritonRegion:
    path = found(module_file, "generated Triton module")
    module = load_module(path.read_text(), path.parent)
    if os.environ.get("TRITON_INTERPRET") != "1":
        # As the executor does after compiling: every kernel built and loaded for this device now.
        # What fails (another GPU's registers or shared memory) raises here, while the graph cache
        # loads, and it compiles the graph afresh, with the executors' fallbacks, instead of failing
        # inside a training step.
        # Tuned launches, if any, from the file beside the binaries: nothing is timed again here.
        from accelrun.compile.codegen.launch_tuning import cached_launches

        warm_up(program, module, cached_launches(program, module_file) if tune else None)
    return TritonRegion(program, module, tune)


def _launch_hooks() -> tuple[Any, Any]:
    """Triton's launch hooks (a profiler's), passed on as triton.jit passes them; (None, None) when no
    one listens (newer tritons keep an empty ``HookChain`` there: calling it, and building the launch
    metadata it would receive, costs a few microseconds per launch)."""
    knobs = _KNOBS[0] if _KNOBS else _load_knobs()
    if knobs is None:
        return None, None
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if getattr(enter, "calls", True) or getattr(leave, "calls", True):
        return enter, leave
    return None, None


_KNOBS: list[Any] = []


def _load_knobs() -> Any:
    try:
        from accelrun.torch_private import triton_knobs as knobs
    except ImportError:  # an older triton, without knobs: no hooks
        knobs = None
    _KNOBS.append(knobs)
    return knobs


def _conform(t: torch.Tensor, buf: Buffer) -> torch.Tensor:
    if t.dtype != buf.dtype or tuple(t.shape) != buf.shape:
        raise ValueError(f"input {buf.name}: expected {buf.dtype} {list(buf.shape)}, got {t.dtype} {list(t.shape)}")
    if all(s == bs or n == 1 for s, bs, n in zip(t.stride(), buf.stride, buf.shape, strict=True)):
        return t
    return torch.empty_strided(buf.shape, buf.stride, dtype=buf.dtype, device=t.device).copy_(t)

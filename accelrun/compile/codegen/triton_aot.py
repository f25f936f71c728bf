"""Compile a generated Triton module's kernels ahead of their first call.

Two uses:

- ``warm_up``: on the GPU at hand, compile (and load) every launch of a region while the executor
  compiles it, so that a kernel Triton's real compiler rejects is a fallback with a reason, not an
  exception at the first training step. ``kernel.warmup`` takes dtypes for the buffers and fills
  the same cache entry a call with aligned tensors uses, so the first call compiles nothing.
- ``cross_compile``: for a named GPU (``GPUTarget("cuda", 90, 32)``: H100; 100: B200) on any machine,
  CPU-only included, and ``ptxas_usage`` to read registers and spills from the PTX with the ptxas that
  ships in Triton's wheel. What this proves: the real compiler accepts the code and it fits the
  registers; not numerics (the interpreter checks those) nor speed.

    for k in cross_compile(program, source, 90):
        print(k.launch.kernel, k.registers, k.spill_bytes)
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accelrun.compile.codegen.loop_ir import LoopProgram
from accelrun.compile.codegen.triton import Launch, launches, scratch_buffers
from accelrun.report.machine_load import usable_cores

# Triton's pointer types for the dtypes a buffer can have.
POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
           torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1"}


def buffer_dtypes(program: LoopProgram) -> dict[str, torch.dtype]:
    """Every name a launch passes (region buffers and split reductions' partials) → its dtype."""
    out = {b.name: b.dtype for b in program.buffers}
    out.update({s.name: s.dtype for s in scratch_buffers(program)})
    return out


MAX_COMPILE_THREADS = 8  # per process: a node's ranks each compile their own kernels at once


def compile_threads(compiles: int) -> int:
    """Threads for ``compiles`` Triton compiles: one each, up to the cores this process may use."""
    return max(1, min(compiles, usable_cores(), MAX_COMPILE_THREADS))


@contextmanager
def parallel_compiles(threads: int) -> Iterator[None]:
    """The Triton compiles started inside (``kernel.warmup``) run on ``threads`` threads and are all
    finished on leaving: Triton's compiler spends its time outside the GIL (MLIR's passes, ptxas), so
    they build side by side. Triton's own asynchronous mode does it: each compile goes to the pool, and
    its kernel into the JIT's cache in this thread once built, so no CUDA context is touched on the
    pool. A failed compile is dropped: its kernel compiles again where it is next asked for, in this
    thread, and raises there (Triton 3.6 also left its mode set after a failure; cleared here)."""
    from accelrun.torch_private import TritonAsyncCompileMode, triton_async_compile_active

    with ThreadPoolExecutor(threads, thread_name_prefix="accelrun-triton-compile") as pool:
        mode = TritonAsyncCompileMode(pool, ignore_errors=True)
        try:
            with mode:
                yield
        finally:
            if triton_async_compile_active.get() is mode:
                triton_async_compile_active.set(None)


def _warm(module: Any, launch: Launch, dtypes: dict[str, torch.dtype]) -> Any:
    """``launch``'s kernel compiled (or found built) for these buffer dtypes, not launched."""
    kernel = getattr(module, launch.kernel)
    return kernel.warmup(*[dtypes[a] for a in launch.args], grid=launch.grid, **launch.options())


def build_ahead(programs: list[tuple[LoopProgram, Any, list[Launch] | None]]) -> None:
    """Every launch of one or more generated modules, ``(program, module, plan)`` each (``plan`` as in
    ``warm_up``), compiled side by side (``parallel_compiles``) and left in their kernels' caches, so
    that ``warm_up`` or a first launch only loads them. Nothing here raises for a kernel: one that
    fails compiles again, and raises, where it is next asked for. Does nothing on one CPU or for one
    launch (no one to build beside)."""
    from accelrun.torch_private import drop_failed_async_compiles

    todo = [(program, module, plan if plan is not None else launches(program)) for program, module, plan in programs]
    threads = compile_threads(sum(len(plan) for _, _, plan in todo))
    if threads < 2:
        return
    by_folder: dict[Path, list[tuple[LoopProgram, Any, list[Launch]]]] = {}
    for item in todo:
        by_folder.setdefault(binaries_dir(item[1].__file__), []).append(item)
    for items in by_folder.values():
        with kernel_binaries_beside(items[0][1].__file__), parallel_compiles(threads):
            for program, module, plan in items:
                dtypes = buffer_dtypes(program)
                for ln in plan:
                    _warm(module, ln, dtypes)
    kernels = {id(k): k for _, module, plan in todo for k in (getattr(module, ln.kernel) for ln in plan)}
    for kernel in kernels.values():
        drop_failed_async_compiles(kernel)


def warm_up(program: LoopProgram, module: Any, plan: list[Launch] | None = None) -> list[str]:
    """Compile and load every launch of ``module`` (as ``plan`` configures them: tuned, or by default
    the generator's) for the current CUDA device; raises what Triton raises (a compile error,
    ``OutOfResources``) for the first launch in order that fails. Returns a line per kernel: its
    registers and spills as the driver loaded it. The launches compile side by side first
    (``build_ahead``); then each is loaded here, in order, and what failed compiles again and raises."""
    plan = plan if plan is not None else launches(program)
    build_ahead([(program, module, plan)])
    dtypes = buffer_dtypes(program)
    out = []
    with kernel_binaries_beside(module.__file__):
        for ln in plan:
            compiled = _warm(module, ln, dtypes)
            init = getattr(compiled, "_init_handles", None)
            if init is not None:
                init()  # loads the binary: where shared memory or register limits are checked
            regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
            out.append(f"{ln.kernel}: {regs} registers, {spills} spills, {ln.num_warps} warps")
    return out


def binaries_dir(module_file: str | os.PathLike) -> Path:
    """Where Triton keeps the compiled binaries of accelrun's kernels: beside their generated modules."""
    return Path(module_file).resolve().parent / "bin"


@contextmanager
def kernel_binaries_beside(module_file: str | os.PathLike) -> Iterator[None]:
    """Triton's on-disk cache (``TRITON_CACHE_DIR``) pointed at ``binaries_dir`` while accelrun's kernels
    compile, whatever the process had: Inductor sets that variable to a folder of its own cache the first
    time it compiles a kernel, so in a process that ran Inductor first (bench/compile_step.py does)
    accelrun's binaries were filed there, a new process looked in Triton's default folder, found none
    and compiled every kernel again (an H100's warm start 7.7 s, as slow as compiling cold)."""
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(binaries_dir(module_file))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old


@dataclass
class CrossCompiled:
    launch: Launch
    arch: int
    compiled: Any  # triton's CompiledKernel
    registers: int | None = None
    spill_stores: int | None = None  # bytes, as ptxas reports them
    spill_loads: int | None = None

    @property
    def spill_bytes(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)


def import_compilable(source: str) -> Any:
    """The generated module imported with ``triton.jit`` compiling (not interpreting), whatever
    TRITON_INTERPRET says: the interpreter decorates kernels into objects that cannot be compiled.
    A fresh module each call (not the executor's cached import)."""
    import triton  # noqa: F401  (imported before the switch, so that its own jit functions are unaffected)

    # The file is needed only while the module runs: triton.jit reads each kernel's source then. Left
    # behind, every call's folder stayed in /tmp (a hundred per test run).
    with tempfile.TemporaryDirectory(prefix="accelrun_triton_aot_") as directory:
        path = Path(directory) / "kernels.py"
        path.write_text(source)
        name = f"accelrun_triton_aot_{abs(hash(source)):x}_{os.getpid()}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        saved = os.environ.pop("TRITON_INTERPRET", None)
        try:
            spec.loader.exec_module(module)
        finally:
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved
    return module


def cross_compile(program: LoopProgram, source: str, arch: int, ptxas: bool = True,
                  plan: list[Launch] | None = None) -> list[CrossCompiled]:  # fmt: skip
    """Every launch of ``program`` (or of ``plan``: launch_tuning's candidates) compiled by Triton for
    ``sm_<arch>`` (no GPU needed); with ``ptxas`` the registers and spills of each. Raises what Triton
    raises for code it rejects."""
    import triton

    from accelrun.torch_private import ASTSource, GPUTarget

    module = import_compilable(source)
    dtypes = buffer_dtypes(program)
    out = []
    for ln in plan if plan is not None else launches(program):
        fn = getattr(module, ln.kernel)
        signature = ({a: POINTER[dtypes[a]] for a in ln.args} | {name: "i32" for name, _ in ln.scalars}
                     | {"BLOCK_R": "constexpr", "BLOCK_N": "constexpr"})
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ln.args))}  # torch's allocations are aligned
        src = ASTSource(fn=fn, signature=signature, constexprs={"BLOCK_R": ln.block_r, "BLOCK_N": ln.block_n},
                        attrs=attrs)
        options = {k: v for k, v in ln.options().items() if k.startswith("num_")}  # warps, and stages where set
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        item = CrossCompiled(ln, arch, compiled)
        if ptxas:
            item.registers, item.spill_stores, item.spill_loads = ptxas_usage(compiled.asm["ptx"], arch)
        out.append(item)
    return out


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of the PTX's kernel, from ``ptxas -v``."""
    from accelrun.torch_private import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", str(path),
                               "-o", os.devnull], capture_output=True, text=True, check=True)
    text = done.stderr + done.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None or spills is None:
        raise RuntimeError(f"ptxas -v printed no register counts:\n{text}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))

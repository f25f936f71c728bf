"""Running a Triton module whose row count is read at each call (``codegen.runtime_rows``).

A mixture of experts' expert meets a different number of tokens on every call; its regions are lowered
once for any count, and each call passes the count to the module's ``launch`` (``n_rows``), which works
out the grids from it. Launches go through ``triton.jit`` every call (it picks the compiled variant for
the count's specialisation: 1, a multiple of 16, or neither), so there is no direct launch and no
launch tuning here: such graphs are the experts, not the launch-bound hot path ``TritonRegion`` serves.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from accelrun.compile.codegen.cached_files import found
from accelrun.compile.codegen.loop_ir import Buffer, LoopProgram
from accelrun.compile.codegen.runtime_rows import leads_with
from accelrun.compile.codegen.triton import load_module, scratch_buffers
from accelrun.compile.codegen.triton_aot import kernel_binaries_beside


class TritonRowsRegion:
    fresh_outputs = True  # every output is a new tensor (read by fast_calls)

    def __init__(self, program: LoopProgram, module: Any) -> None:
        self.program, self.module = program, module
        self.module_file = str(Path(module.__file__).resolve())
        rows = program.runtime_rows
        leads = dict(rows.leading_axes)
        self.inputs = program.of_role("input")
        self._source = next(i for i, b in enumerate(self.inputs) if b.name == rows.input)
        # (buffer, whether its leading size is the call's n, its leading axes read as rows or None)
        self._in = [(b, b.name in rows.buffers, leads.get(b.name)) for b in self.inputs]
        self._out = [(b, b.name in rows.buffers, leads.get(b.name)) for b in program.of_role("output")]
        self._temps = [(b, b.name in rows.buffers) for b in program.of_role("temp")]
        self._scratch = [(s.shape, s.dtype) for s in scratch_buffers(program)]
        self._sizes = frozenset(program.size_inputs)  # sizes among the inputs: not passed on

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...]:
        if self._sizes:
            args = tuple(a for i, a in enumerate(args) if i not in self._sizes)
        if len(args) != len(self.inputs):
            raise TypeError(f"compiled region takes {len(self.inputs) + len(self._sizes)} inputs, got {len(args)}")
        source, (_, _, lead) = args[self._source], self._in[self._source]
        n = source.shape[0] if lead is None else math.prod(source.shape[: len(lead)])
        ins = [_as_rows(t, buf, dynamic, lead, n) for t, (buf, dynamic, lead) in zip(args, self._in, strict=True)]
        device = source.device
        outs = [_empty(buf, dynamic, n, device) for buf, dynamic, _ in self._out]
        temps = [_empty(buf, dynamic, n, device) for buf, dynamic in self._temps]
        scratch = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self._scratch]
        # A count of another specialisation (1, a multiple of 16, neither) compiles here, during a step:
        # its binaries go where accelrun keeps its kernels' (not Inductor's folder, if it ran first).
        with kernel_binaries_beside(self.module_file):
            self.module.launch(*ins, *outs, *temps, *scratch, n)
        return tuple(t if lead is None else t.view(*_lead_sizes(lead, n), *t.shape[1:])
                     for t, (_, _, lead) in zip(outs, self._out, strict=True))  # fmt: skip

    def __reduce__(self) -> tuple:  # the graph cache: the module found again by its file
        return (_restore_rows_region, (self.module_file, self.program))


def _restore_rows_region(module_file: str, program: LoopProgram) -> TritonRowsRegion:
    path = found(module_file, "generated Triton module")
    return TritonRowsRegion(program, load_module(path.read_text(), path.parent))


def _empty(buf: Buffer, dynamic: bool, n: int, device: torch.device) -> torch.Tensor:
    # A buffer with n rows is laid out as rows (runtime_rows checks it): its strides hold for any n.
    shape = (n, *buf.shape[1:]) if dynamic else buf.shape
    return torch.empty_strided(shape, buf.stride, dtype=buf.dtype, device=device)


def _lead_sizes(lead: tuple[int, ...], n: int) -> tuple[int, ...]:
    """An output's leading axes for ``n`` rows (its -1 worked out here: ``view`` cannot when n is 0)."""
    known = math.prod(a for a in lead if a != -1)
    return tuple(n // known if a == -1 else a for a in lead)


def _as_rows(t: torch.Tensor, buf: Buffer, dynamic: bool, lead: tuple[int, ...] | None, n: int) -> torch.Tensor:
    """An input as the kernels read it: its leading axes as rows, in the buffer's layout (a copy only
    where it is laid out otherwise)."""
    if lead is not None:
        if not leads_with(t, lead, buf.shape[1:]):
            raise ValueError(f"compiled region: an input of sizes {list(t.shape)} where "
                             f"{[*lead, *buf.shape[1:]]} (-1: any) was expected")  # fmt: skip
        t = t.reshape(n, *buf.shape[1:])
    shape = (n, *buf.shape[1:]) if dynamic else buf.shape
    if t.dtype != buf.dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"input {buf.name}: expected {buf.dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if all(s == want or size == 1 for s, want, size in zip(t.stride(), buf.stride, shape, strict=True)):
        return t
    return torch.empty_strided(shape, buf.stride, dtype=buf.dtype, device=t.device).copy_(t)

"""What accelrun's own code generators (``cpp``, ``triton``) share: a region is theirs when its
tensors live where their kernels run and the loop IR can express it; the generated source is kept in
``region.lowering.sources`` so that declining, compiling and the explain dump all use one copy."""

from __future__ import annotations

from abc import abstractmethod
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar

from accelrun.compile.codegen.linear_sizes import lower_with_linear_sizes
from accelrun.compile.codegen.loop_ir import Unsupported, cached_program
from accelrun.compile.codegen.runtime_rows import lower_with_runtime_rows
from accelrun.compile.executors.base import Executor
from accelrun.compile.regions import GeneratedSource, Region


def device_types(region: Region) -> set[str]:
    return {m.device.type for m in (*region.input_meta, *region.output_meta) if hasattr(m, "device")}


def _region_sizes(region: Region) -> list[Any]:
    return [n for m in (*region.input_meta, *region.output_meta) if hasattr(m, "shape") for n in (*m.shape, *m.stride())]


def symbolic_sizes(region: Region) -> bool:
    """Whether a tensor of the region has a size or stride that is a symbol (a dimension Dynamo saw
    change between calls, as a mixture of experts' tokens per expert, or a data-dependent one)."""
    return any(not isinstance(n, int) for n in _region_sizes(region))


def data_dependent_sizes(region: Region) -> bool:
    """Whether one of those symbols stands for a value read from the data (the rows a boolean mask
    picks): it has no value to read as a number at all."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(free_unbacked_symbols(n) for n in _region_sizes(region) if not isinstance(n, int))


# A symbolic size that is only ever the rows a kernel loops over is read at each call (C++ kernels,
# codegen.runtime_rows): no guard, one graph for every size. Otherwise the generated kernels are
# written for fixed sizes: a symbolic size is read as a number, and Dynamo then guards on that value.
# That is right for a size that changed once (a last, shorter batch; an evaluation's batch) or that
# Dynamo made symbolic from an earlier model or profile: the graph stays as fast as before. For a size
# that changes on every call (a mixture of experts' tokens per expert) it compiled the graph again for
# every size, and past Dynamo's recompile limit the calls ran eagerly. So once a function has compiled
# this often in the run, its symbolic sizes stay symbols and such regions stay in ATen.
SPECIALIZING_COMPILES = 2
SYMBOLIC_SIZES = "sizes that kept changing between calls (dynamic shapes)"
DATA_DEPENDENT_SIZES = "sizes that depend on the data (the rows a mask or a router picks)"
# How many graphs of the function being compiled this run compiled before (the backend sets it for
# Dynamo's frames, the graph cache for its methods); None: no compile that could guard is under way
# (a graph lowered again from the graph cache), where a symbolic size is never read as a number.
earlier_compiles: ContextVar[int | None] = ContextVar("accelrun_earlier_compiles", default=None)


@contextmanager
def compiling_after(count: int):
    token = earlier_compiles.set(count)
    try:
        yield
    finally:
        earlier_compiles.reset(token)


def with_runtime_rows(region: Region) -> bool:
    """Whether the region's program reads its row count at each call: lowered so, once, on the region
    (``region.program``), where the changing size is only ever the rows its kernels loop over. Such a
    program needs no guard on the size, so it is tried before a size is read as a number. Where it
    does not apply, why is kept beside the reason the region then gets (``runtime_rows_error``)."""
    if region.program is None and region.program_error is None and region.runtime_rows_error is None:
        try:
            region.program = lower_with_runtime_rows(region)
        except Unsupported as e:
            region.runtime_rows_error = str(e)
            # The length elsewhere in the sizes, each a·s + b (codegen.linear_sizes): for a graph past
            # the first compiles only, whose kernels written for one size are faster where it holds.
            if sizes_keep_changing() and not data_dependent_sizes(region):
                try:
                    region.program = lower_with_linear_sizes(region)
                except Unsupported as also:
                    region.runtime_rows_error += f"; nor as a·s + b in every size ({also})"
    program = region.program
    return program is not None and (program.runtime_rows is not None or program.linear_sizes is not None)


def sizes_keep_changing() -> bool:
    count = earlier_compiles.get()
    return count is None or count >= SPECIALIZING_COMPILES


class GeneratedCodeExecutor(Executor):
    device_type: ClassVar[str]  # where the generated kernels run: "cpu" or "cuda"
    source_ext: ClassVar[str]  # file extension of the source in the explain dump
    # Whether its kernels can read their row count at each call (codegen.runtime_rows).
    runtime_rows: ClassVar[bool] = False

    @abstractmethod
    def generate(self, program: Any) -> str:
        """Source code for a lowered loop program."""

    def runs_anywhere(self) -> bool:
        """True when the kernels can take tensors on any device (an interpreter)."""
        return False

    def decline_reason(self, region: Region) -> str | None:
        foreign = device_types(region) - {self.device_type}
        if foreign and not self.runs_anywhere():
            return f"tensors on {', '.join(sorted(foreign))}: {self.name} kernels run on {self.device_type} tensors"
        if symbolic_sizes(region) and not (self.runtime_rows and with_runtime_rows(region)):
            if data_dependent_sizes(region):  # reading one as a number raised "could not guard on data-dependent"
                return f"{DATA_DEPENDENT_SIZES}: {self._fixed_sizes_reason(region)}"
            if sizes_keep_changing():
                return f"{SYMBOLIC_SIZES}: {self._fixed_sizes_reason(region)}"
        try:
            self.source(region)
        except Unsupported as e:
            return str(e)
        return None

    def _fixed_sizes_reason(self, region: Region) -> str:
        if self.runtime_rows and region.runtime_rows_error is not None:
            return region.runtime_rows_error
        return f"{self.name} kernels are generated for fixed sizes"

    def source(self, region: Region) -> str:
        read_at_call = region.program is not None and (region.program.runtime_rows or region.program.linear_sizes)
        if read_at_call and not self.runtime_rows:
            raise Unsupported(f"{SYMBOLIC_SIZES}: {self._fixed_sizes_reason(region)}")
        sources = region.lowering.sources
        if self.name not in sources:
            program = cached_program(region)
            if program.size_inputs and not self.runtime_rows:
                raise Unsupported(f"a size among the region's inputs ({self.name} kernels take tensors only)")
            sources[self.name] = GeneratedSource(self.generate(program), self.source_ext)
        return sources[self.name].text

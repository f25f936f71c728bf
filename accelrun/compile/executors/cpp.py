"""accelrun's own C++/OpenMP code generation for fusion regions (see ``compile/codegen``).

Claims a region when the loop IR can express it (pointwise ops, views, reductions over leading or
trailing axes, fp32/bf16); compiles it with g++ once and reuses the library from the on-disk cache.
"""

from __future__ import annotations

from accelrun.compile.codegen.cpp import ENTRY, PRELUDE, cpp_region, cpp_source, saved_region
from accelrun.compile.codegen.cpp_build import build_and_load, find_compiler, is_cached, library_path
from accelrun.compile.codegen.loop_ir import cached_program
from accelrun.compile.executors.base import RegionFn, register_executor
from accelrun.compile.executors.generated import GeneratedCodeExecutor
from accelrun.compile.regions import Region


@register_executor
class CppExecutor(GeneratedCodeExecutor):
    name = "cpp"
    parallel_compile = True  # g++ runs as a subprocess, on the lowering's build threads
    # A graph's regions build as one library: g++ starts, reads the prelude and links once (12 regions
    # of the debug Llama: 0.5 s of one core, against 2.6 s as 12 libraries).
    batch_compile = True
    device_type = "cpu"
    source_ext = "cpp"
    runtime_rows = True

    def unavailable_reason(self) -> str | None:
        if find_compiler() is None:
            return "no C++ compiler: g++ is not on the PATH (set ACCELRUN_CXX to use another)"
        return None

    def compile(self, region: Region, cache_dir: str | None) -> RegionFn:
        source = self.source(region)
        region.lowering.cache_hit = is_cached(source, cache_dir)
        lib = build_and_load(source, cache_dir, needed_later=_needed_later([region]))
        return cpp_region(cached_program(region), lib)

    def compile_batch(self, regions: list[Region], cache_dir: str | None) -> list[RegionFn]:
        source, entries = self._batch(regions)
        hit = is_cached(source, cache_dir)
        lib = build_and_load(source, cache_dir, needed_later=_needed_later(regions))
        for region in regions:
            region.lowering.cache_hit = hit
        return [cpp_region(cached_program(r), lib, entry) for r, entry in zip(regions, entries, strict=True)]

    def saved_forms(self, regions: list[Region], cache_dir: str | None) -> list[tuple | None]:
        # The library's path is the hash of its source: known before g++ has run. Not for a region
        # whose kernels read a length (codegen.linear_sizes): the build checks it first, and one that
        # fails goes to the next executor, so the cache saves it once its build is done.
        source, entries = self._batch(regions)
        library = str(library_path(source, cache_dir))
        programs = [cached_program(r) for r in regions]
        return [None if program.linear_sizes is not None else saved_region(library, entry, program)
                for program, entry in zip(programs, entries, strict=True)]  # fmt: skip

    def _batch(self, regions: list[Region]) -> tuple[str, list[str]]:
        """One library's source for ``regions`` and each one's entry point; identical regions (a model's
        repeated layers in one graph) share one entry, so the source grows with the distinct ones only."""
        entry_of: dict[str, str] = {}
        parts, entries = [PRELUDE], []
        for region in regions:
            own = self.source(region)  # the region's standalone source, made when it was claimed
            if own not in entry_of:
                entry_of[own] = f"{ENTRY}_{len(entry_of)}"
                parts.append(cpp_source(cached_program(region), entry_of[own], prelude=False))
            entries.append(entry_of[own])
        return "".join(parts), entries

    def generate(self, program) -> str:
        return cpp_source(program)


def _needed_later(regions: list[Region]) -> bool:
    """A backward graph's regions: their library is first called after the whole forward has run."""
    return all(r.graph_kind == "backward" for r in regions)

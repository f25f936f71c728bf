"""accelrun's own C++/OpenMP code generation for fusion regions (see ``compile/codegen``).

Claims a region when the loop IR can express it (pointwise ops, views, reductions over leading or
trailing axes, fp32/bf16); compiles it with g++ once and reuses the library from the on-disk cache.
"""

from __future__ import annotations

from accelrun.compile.codegen.cpp import ENTRY, PRELUDE, CppRegion, cpp_source
from accelrun.compile.codegen.cpp_build import build_library, find_compiler, library_path, load_library
from accelrun.compile.codegen.loop_ir import cached_program
from accelrun.compile.executors.base import RegionFn, register_executor
from accelrun.compile.executors.generated import GeneratedCodeExecutor
from accelrun.compile.regions import Region


@register_executor
class CppExecutor(GeneratedCodeExecutor):
    name = "cpp"
    parallel_compile = True  # g++ runs as a subprocess; regions build concurrently
    # A graph's regions build as one library: g++ starts, reads the prelude and links once (12 regions
    # of the debug Llama: 0.5 s of one core, against 2.6 s as 12 libraries).
    batch_compile = True
    device_type = "cpu"
    source_ext = "cpp"

    def unavailable_reason(self) -> str | None:
        if find_compiler() is None:
            return "no C++ compiler: g++ is not on the PATH (set ACCELRUN_CXX to use another)"
        return None

    def compile(self, region: Region, cache_dir: str | None) -> RegionFn:
        source = self.source(region)
        region.lowering.cache_hit = library_path(source, cache_dir).exists()
        lib = load_library(build_library(source, cache_dir))
        return CppRegion(cached_program(region), lib)

    def compile_batch(self, regions: list[Region], cache_dir: str | None) -> list[RegionFn]:
        entries = [f"{ENTRY}_{n}" for n in range(len(regions))]
        source = PRELUDE + "".join(cpp_source(cached_program(r), entry, prelude=False)
                                   for r, entry in zip(regions, entries, strict=True))
        hit = library_path(source, cache_dir).exists()
        lib = load_library(build_library(source, cache_dir))
        for region in regions:
            region.lowering.cache_hit = hit
        return [CppRegion(cached_program(r), lib, entry) for r, entry in zip(regions, entries, strict=True)]

    def generate(self, program) -> str:
        return cpp_source(program)

"""Triton's compiler on several threads at once, on any machine: every launch candidate of the RMSNorm
regions at width 4096 (what ``compile.tune_launches`` builds on a GPU before timing them) cross-compiled
for sm_90, one after another and then on a pool of threads. ``triton_aot.parallel_compiles`` hands the
JIT's compiles to such a pool through Triton's asynchronous mode, which needs a GPU to drive; this
measures what that relies on, Triton's compiler running outside the GIL, on this machine's CPUs.

    python bench/triton_parallel_compile.py             # threads: as parallel_compiles would use here
    python bench/triton_parallel_compile.py --threads 4

Each measure compiles into a fresh Triton cache, so nothing is found built. Time on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelrun.compile.codegen import triton as triton_codegen  # noqa: E402
from accelrun.compile.codegen.launch_tuning import candidates  # noqa: E402
from accelrun.compile.codegen.loop_ir import cached_program  # noqa: E402
from accelrun.compile.codegen.triton import launches  # noqa: E402
from accelrun.compile.codegen.triton_aot import compile_threads, cross_compile  # noqa: E402
from tests.compile.test_triton_real_compile import regions_of, rmsnorm  # noqa: E402


def jobs() -> list[tuple]:
    regions = regions_of(rmsnorm, torch.randn(2, 4, 4096, requires_grad=True), torch.randn(4096, requires_grad=True))
    out = []
    for region in regions:
        program = cached_program(region)
        source = triton_codegen.triton_source(program)
        out += [(program, source, c) for ln in launches(program) for c in candidates(program, ln)]
    return out


def build(job: tuple) -> None:
    program, source, launch = job
    cross_compile(program, source, 90, ptxas=False, plan=[launch])


def timed(work: list[tuple], threads: int) -> float:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="accelrun-bench-triton-")
    t0 = time.perf_counter()
    if threads == 1:
        for job in work:
            build(job)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(build, work))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="0: as many as parallel_compiles would use here")
    args = p.parse_args()
    work = jobs()
    threads = args.threads or compile_threads(len(work))
    print(f"{len(work)} candidates of {len({id(j[0]) for j in work})} regions, cross-compiled for sm_90; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    timed(work[:1], 1)  # untimed: Triton's first compile in a process loads its backends
    serial = timed(work, 1)
    pooled = timed(work, threads)
    print(f"one after another: {serial:.2f} s; on {threads} threads: {pooled:.2f} s ({serial / pooled:.2f}x)")


if __name__ == "__main__":
    main()

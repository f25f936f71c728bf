"""Give each fusion region to the first executor (in the recipe's priority order) that claims it.

Claims are decided first, one region at a time (a decline is cheap); then the claimed regions are
compiled, concurrently for executors whose compiler runs outside Python (``parallel_compile``: the
C++ executor's g++ processes), one by one for the others. A region whose compile fails goes on down
the list, so a code-generator bug costs speed, never a run.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from torch import fx

from accelrun.compile.executors.base import Executor, registered_executors
from accelrun.compile.record import CompileRecord, RegionRecord
from accelrun.compile.regions import REGION_KEY, Region


def make_executors(names: list[str]) -> list[Executor]:
    known = registered_executors()
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"unknown executor(s) {missing}; known: {', '.join(known)}")
    return [known[n]() for n in names]


def lower_regions(
    gm: fx.GraphModule,
    graph_name: str,
    graph_kind: str,
    executors: list[Executor],
    record: CompileRecord,
    cache_dir: str,
) -> tuple[fx.GraphModule, list[Region]]:
    """Replace each marked region by a call to its compiled form. Regions the ``aten`` executor takes
    stay as they are (their ops already are ATen calls). Returns the new module and the regions."""
    if not any(REGION_KEY in n.meta for n in gm.graph.nodes):
        return gm, []
    from accelrun.compile.extract import extract_regions, replace_regions

    lowering = _Lowering(executors, cache_dir)
    regions = extract_regions(gm, graph_kind)
    for region in regions:
        region.graph_kind = graph_kind
    compiled = lowering.run(regions)
    for region in regions:
        _note(record, graph_name, region)
    # Unmark the regions left to aten so that only compiled ones are cut out of the graph.
    for node in gm.graph.nodes:
        if node.meta.get(REGION_KEY) is not None and node.meta[REGION_KEY] not in compiled:
            del node.meta[REGION_KEY]
    return (replace_regions(gm, compiled) if compiled else gm), regions


class _Lowering:
    def __init__(self, executors: list[Executor], cache_dir: str) -> None:
        self.executors = executors
        self.cache_dir = cache_dir
        self.unavailable = {e.name: e.unavailable_reason() for e in executors}

    def run(self, regions: list[Region]) -> dict[int, object]:
        compiled: dict[int, object] = {}
        claims = {r.id: self._claim(r, 0) for r in regions}
        by_id = {r.id: r for r in regions}
        parallel = [r for r in regions if claims[r.id] is not None and self.executors[claims[r.id]].parallel_compile]
        results: dict[int, tuple[object | None, str | None, float]] = {}
        if parallel:
            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                futures = {r.id: pool.submit(self._compile, r, claims[r.id]) for r in parallel}
                results = {rid: f.result() for rid, f in futures.items()}
        for rid, index in claims.items():
            region = by_id[rid]
            while index is not None:
                fn, error, seconds = results.pop(rid, None) or self._compile(region, index)
                if error is None:
                    region.facts["executor"] = self.executors[index].name
                    region.facts["compile_s"] = seconds
                    if fn is not None:
                        compiled[rid] = fn
                    break
                region.facts.setdefault("declined", {})[self.executors[index].name] = error
                index = self._claim(region, index + 1)
            if index is None:
                # Nobody claimed it (aten was left out of compile.executors): its ops run as ATen calls anyway.
                region.facts.setdefault("declined", {})["aten"] = "not in compile.executors (used anyway: the fallback)"
                region.facts["executor"] = "aten"
        return compiled

    def _claim(self, region: Region, start: int) -> int | None:
        """Index of the first executor from ``start`` on that claims the region; declines noted."""
        for i in range(start, len(self.executors)):
            ex = self.executors[i]
            reason = self.unavailable[ex.name] or ex.decline_reason(region)
            if reason is None:
                return i
            region.facts.setdefault("declined", {})[ex.name] = reason
        return None

    def _compile(self, region: Region, index: int) -> tuple[object | None, str | None, float]:
        ex = self.executors[index]
        if ex.name == "aten":
            return None, None, 0.0  # left in the graph as it is
        t0 = time.perf_counter()
        try:
            fn = ex.compile(region, f"{self.cache_dir}/{ex.name}")
        except Exception as e:  # a compiler bug must not stop training: the next executor takes it
            first = str(e).splitlines()[0] if str(e) else ""
            return None, f"compile failed: {type(e).__name__}: {first}"[:240], time.perf_counter() - t0
        return fn, None, time.perf_counter() - t0


def _note(record: CompileRecord, graph: str, region: Region) -> None:
    record.regions.append(RegionRecord(
        graph=graph, region=region.id, ops=region.ops, executor=region.facts.get("executor", "aten"),
        declined=dict(region.facts.get("declined", {})), compile_s=round(region.facts.get("compile_s", 0.0), 4),
        cache_hit=region.facts.get("cache_hit"),
    ))  # fmt: skip
    if region.facts.get("cache_hit") is True:
        record.cache_hits += 1
    elif region.facts.get("cache_hit") is False:
        record.cache_misses += 1

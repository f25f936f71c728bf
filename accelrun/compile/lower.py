"""Give each fusion region to the first executor (in the recipe's priority order) that claims it."""

from __future__ import annotations

import time

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

    unavailable = {e.name: e.unavailable_reason() for e in executors}
    regions = extract_regions(gm)
    compiled = {}
    for region in regions:
        region.graph_kind = graph_kind
        declined: dict[str, str] = {}
        for ex in executors:
            reason = unavailable[ex.name] or ex.decline_reason(region)
            if reason is None and ex.name != "aten":
                t0 = time.perf_counter()
                try:
                    compiled[region.id] = ex.compile(region, f"{cache_dir}/{ex.name}")
                except Exception as e:  # a compiler bug must not stop training: the next executor takes it
                    reason = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:240]
                else:
                    _note(record, graph_name, region, ex.name, declined, time.perf_counter() - t0)
                    break
            if reason is None:  # aten
                _note(record, graph_name, region, "aten", declined, 0.0)
                break
            declined[ex.name] = reason
        else:
            # Nobody claimed it (aten was left out of compile.executors): its ops run as ATen calls anyway.
            declined["aten"] = "not in compile.executors (used anyway: it is the fallback)"
            _note(record, graph_name, region, "aten", declined, 0.0)
    # Unmark the regions left to aten so that only compiled ones are cut out of the graph.
    for node in gm.graph.nodes:
        if node.meta.get(REGION_KEY) is not None and node.meta[REGION_KEY] not in compiled:
            del node.meta[REGION_KEY]
    return (replace_regions(gm, compiled) if compiled else gm), regions


def _note(record: CompileRecord, graph: str, region: Region, executor: str, declined: dict[str, str],
          seconds: float) -> None:  # fmt: skip
    region.facts["executor"] = executor
    region.facts["declined"] = dict(declined)
    record.regions.append(RegionRecord(
        graph=graph, region=region.id, ops=region.ops, executor=executor, declined=dict(declined),
        compile_s=round(seconds, 4), cache_hit=region.facts.get("cache_hit"),
    ))  # fmt: skip
    if region.facts.get("cache_hit") is True:
        record.cache_hits += 1
    elif region.facts.get("cache_hit") is False:
        record.cache_misses += 1

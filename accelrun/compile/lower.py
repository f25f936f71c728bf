"""Give each fusion region to the first executor (in the recipe's priority order) that claims it.

Claims are decided first, one region at a time (a decline is cheap); then the claimed regions are
compiled, concurrently for executors whose compiler runs outside Python (``parallel_compile``: the
C++ executor's g++ processes), one by one for the others; an executor with ``batch_compile`` gets all
its regions in one call (one g++ run for a graph). A region whose compile fails goes on down
the list, so a code-generator bug costs speed, never a run. So does one whose claim raises, and a
compiled region that raises at its first call, or returns outputs unlike its nodes' (shape, dtype,
strides: the graph after it was traced against those): ``FirstCallCheck`` hands it to the next
executor then, ending at ``aten``. Each such fallback is in ``record.fallbacks`` with its reason;
with ``compile.strict`` it is an error instead (``CompilerFallbackError``).
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

from torch import fx

from accelrun.compile.executors.aten import AtenExecutor
from accelrun.compile.executors.base import Executor, registered_executors
from accelrun.compile.pipeline import CompilerFallbackError, one_line
from accelrun.compile.record import CompileRecord, Fallback, RegionRecord
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
    strict: bool = False,
) -> tuple[fx.GraphModule, list[Region]]:
    """Replace each marked region by a call to its compiled form. Regions the ``aten`` executor takes
    stay as they are (their ops already are ATen calls). Returns the new module and the regions."""
    if not any(REGION_KEY in n.meta for n in gm.graph.nodes):
        return gm, []
    from accelrun.compile.extract import extract_regions, replace_regions

    lowering = _Lowering(executors, cache_dir, strict, _Fallbacks(record, graph_name, strict))
    regions = extract_regions(gm, graph_kind)
    for region in regions:
        region.graph_kind = graph_kind
    compiled = lowering.run(regions)
    for region in regions:
        _note(record, graph_name, region)
    by_id = {r.id: r for r in regions}
    compiled = {rid: FirstCallCheck(fn, by_id[rid], lowering) for rid, fn in compiled.items()}
    # Unmark the regions left to aten so that only compiled ones are cut out of the graph.
    for node in gm.graph.nodes:
        if node.meta.get(REGION_KEY) is not None and node.meta[REGION_KEY] not in compiled:
            del node.meta[REGION_KEY]
    return (replace_regions(gm, compiled) if compiled else gm), regions


class _Fallbacks:
    """Notes a fallback in the record (the region's row too), or raises under ``compile.strict``."""

    def __init__(self, record: CompileRecord | None, graph: str, strict: bool) -> None:
        self.record, self.graph, self.strict = record, graph, strict

    def __call__(self, stage: str, region: Region, executor: str, reason: str, to: str | None = None) -> None:
        what = f"region {region.id}: {executor}" + (f" → {to}" if to else "")
        if self.strict:
            raise CompilerFallbackError(f"{self.graph} {stage} {what}: {reason} (compile.strict is on)")
        if self.record is None:
            return
        self.record.fallbacks.append(Fallback(self.graph, stage, what, reason))
        if to is not None:  # decided after the region was noted: its row says who runs it now
            for row in self.record.regions:
                if row.graph == self.graph and row.region == region.id:
                    row.declined[executor] = f"{stage}: {reason}"
                    row.executor = to


class _Lowering:
    def __init__(self, executors: list[Executor], cache_dir: str, strict: bool = False,
                 fallbacks: _Fallbacks | None = None) -> None:  # fmt: skip
        self.executors = executors
        self.cache_dir = cache_dir
        self.unavailable = {e.name: e.unavailable_reason() for e in executors}
        self.fallbacks = fallbacks or _Fallbacks(None, "?", strict)

    def run(self, regions: list[Region]) -> dict[int, object]:
        compiled: dict[int, object] = {}
        claims = {r.id: self._claim(r, 0) for r in regions}
        by_id = {r.id: r for r in regions}
        results: dict[int, tuple[object | None, str | None, float]] = {}
        jobs = self._compile_jobs(regions, claims)
        if jobs:
            with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
                for done in [pool.submit(job) for job in jobs]:
                    results.update(done.result())
        for rid, index in claims.items():
            region = by_id[rid]
            while index is not None:
                fn, error, seconds = results.pop(rid, None) or self._compile(region, index)
                if error is None:
                    region.lowering.executor = self.executors[index].name
                    region.lowering.compile_s = seconds
                    if fn is not None:
                        compiled[rid] = fn
                    break
                region.lowering.declined[self.executors[index].name] = error
                self.fallbacks("compile", region, self.executors[index].name, error)
                index = self._claim(region, index + 1)
            if index is None:
                # Nobody claimed it (aten was left out of compile.executors): its ops run as ATen calls anyway.
                region.lowering.declined[AtenExecutor.name] = "not in compile.executors (used anyway: the fallback)"
                region.lowering.executor = AtenExecutor.name
        return compiled

    def _compile_jobs(self, regions: list[Region], claims: dict[int, int | None]) -> list:
        """What runs concurrently before the regions are placed: for each ``parallel_compile`` executor,
        one job for all its regions when it has ``batch_compile``, else a job per region. Each job
        returns {region id: (fn, error, seconds)}; a region it leaves out is compiled alone afterwards."""
        jobs = []
        for index, executor in enumerate(self.executors):
            mine = [r for r in regions if claims[r.id] == index]
            if not mine or not executor.parallel_compile:
                continue
            if executor.batch_compile and len(mine) > 1:
                jobs.append(functools.partial(self._compile_batch, mine, index))
            else:
                jobs += [functools.partial(self._compile_alone, r, index) for r in mine]
        return jobs

    def _compile_alone(self, region: Region, index: int) -> dict[int, tuple[object | None, str | None, float]]:
        return {region.id: self._compile(region, index)}

    def _compile_batch(self, regions: list[Region], index: int) -> dict[int, tuple[object | None, str | None, float]]:
        ex = self.executors[index]
        t0 = time.perf_counter()
        try:
            fns = ex.compile_batch(regions, f"{self.cache_dir}/{ex.name}")
        except Exception:  # compiled one by one afterwards: the region at fault then declines alone
            return {}
        share = (time.perf_counter() - t0) / len(regions)  # one build: each region's share of it
        return {r.id: (fn, None, share) for r, fn in zip(regions, fns, strict=True)}

    def _claim(self, region: Region, start: int) -> int | None:
        """Index of the first executor from ``start`` on that claims the region; declines noted."""
        for i in range(start, len(self.executors)):
            ex = self.executors[i]
            try:
                reason = self.unavailable[ex.name] or ex.decline_reason(region)
            except Exception as e:  # a bug in deciding: the next executor is asked
                reason = f"claim raised {one_line(e)}"
                self.fallbacks("claim", region, ex.name, reason)
            if reason is None:
                return i
            region.lowering.declined[ex.name] = reason
        return None

    def _compile(self, region: Region, index: int) -> tuple[object | None, str | None, float]:
        ex = self.executors[index]
        if ex.keeps_aten_ops:
            return None, None, 0.0  # left in the graph as it is
        t0 = time.perf_counter()
        try:
            fn = ex.compile(region, f"{self.cache_dir}/{ex.name}")
        except Exception as e:  # a compiler bug must not stop training: the next executor takes it
            return None, f"compile failed: {one_line(e)}", time.perf_counter() - t0
        return fn, None, time.perf_counter() - t0

    def next_after(self, region: Region, current: Executor) -> tuple[Executor, object]:
        """The next executor after ``current`` that claims and compiles ``region`` (at run time, after a
        first call failed); ``aten`` (the region's own ATen ops) when none does."""
        index = next((i for i, e in enumerate(self.executors) if e is current), len(self.executors)) + 1
        while (index := self._claim(region, index)) is not None:
            fn, error, _ = self._compile(region, index)
            ex = self.executors[index]
            if error is None:
                return ex, fn if fn is not None else region.gm
            self.fallbacks("compile", region, ex.name, error)
            index += 1
        return AtenExecutor(), region.gm

    def executor_named(self, name: str | None) -> Executor:
        return next((e for e in self.executors if e.name == name), AtenExecutor())


class FirstCallCheck:
    """A compiled region whose first call is checked: it must not raise, and its outputs must have the
    shapes, dtypes and strides of the region's nodes (``meta["val"]``), which the graph after it was
    traced against. Otherwise the region goes to the next executor, ending at ``aten``."""

    def __init__(self, fn: object, region: Region, lowering: _Lowering) -> None:
        self.fn, self.region, self.lowering = fn, region, lowering
        self.runner = lowering.executor_named(region.lowering.executor)
        self.checked = False

    @property
    def fresh_outputs(self) -> bool:
        """Every output is a new tensor (fast_calls may then collapse views of it)."""
        return getattr(self.fn, "fresh_outputs", False)

    def __call__(self, *args):
        if self.checked:
            return self.fn(*args)
        while True:
            try:
                out = self.fn(*args)
                problem = layout_problem(out, self.region.output_meta)
            except Exception as e:
                if self.runner.keeps_aten_ops:
                    raise  # the region's own ATen ops: an error of the program, not of the compiler
                out, problem = None, f"first call raised {one_line(e)}"
            if problem is None or self.runner.keeps_aten_ops:
                self.checked = True
                return out
            runner, fn = self.lowering.next_after(self.region, self.runner)
            self.lowering.fallbacks("first call", self.region, self.runner.name, problem, to=runner.name)
            self.runner, self.fn = runner, fn
            if runner.keeps_aten_ops:
                self.fn = _as_tuple(fn)

    def __reduce__(self):
        # The graph cache saves what runs (a CppRegion pickles as its library's path).
        return self.fn.__reduce__()


def _as_tuple(gm: object):
    def run(*args):
        out = gm(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return run


def layout_problem(out: object, metas: list) -> str | None:
    """Why ``out`` is not what the graph expects from the region, or None."""
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(outs) != len(metas):
        return f"returned {len(outs)} outputs, the graph expects {len(metas)}"
    for k, (t, m) in enumerate(zip(outs, metas, strict=True)):
        if not (hasattr(m, "shape") and hasattr(t, "shape")):
            continue
        if not all(isinstance(n, int) for n in (*m.shape, *m.stride())):
            continue  # symbolic sizes: comparing them here would guard on a finished trace
        if tuple(t.shape) != tuple(m.shape) or t.dtype != m.dtype:
            return f"output {k} is {t.dtype} {list(t.shape)}, the graph expects {m.dtype} {list(m.shape)}"
        if t.numel() > 1 and any(a != b for a, b, n in zip(t.stride(), m.stride(), m.shape, strict=True) if n > 1):
            return f"output {k} has strides {list(t.stride())}, the graph expects {list(m.stride())}"
    return None


def _note(record: CompileRecord, graph: str, region: Region) -> None:
    done = region.lowering
    record.regions.append(RegionRecord(
        graph=graph, region=region.id, ops=region.ops, executor=done.executor or AtenExecutor.name,
        declined=dict(done.declined), compile_s=round(done.compile_s, 4), cache_hit=done.cache_hit,
    ))  # fmt: skip
    if done.cache_hit is True:
        record.cache_hits += 1
    elif done.cache_hit is False:
        record.cache_misses += 1

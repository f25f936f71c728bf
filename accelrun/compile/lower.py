"""Give each fusion region to the first executor (in the recipe's priority order) that claims it.

Claims are decided first, one region at a time (a decline is cheap); then the claimed regions are
compiled: one by one, or, for executors whose compiler runs outside Python (``parallel_compile``: the
C++ executor's g++), on a pool of build threads, an executor with ``batch_compile`` getting all its
regions in one job (one g++ run for a graph). The lowering does not wait for the pool: such a region is
placed as a ``PendingBuild``, and its first call waits for the build, so g++ runs beside AOTAutograd's
next graph and the step's first ops. A region whose compile fails goes on down the list, so a
code-generator bug costs speed, never a run. So does one whose claim raises, and a
compiled region that raises at its first call, or returns outputs unlike its nodes' (shape, dtype,
strides: the graph after it was traced against those): ``FirstCallCheck`` hands it to the next
executor then, ending at ``aten``. Each such fallback is in ``record.fallbacks`` with its reason;
with ``compile.strict`` it is an error instead (``CompilerFallbackError``).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import fx

from accelrun.compile.activity import ACTIVITY
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
    wait_for_builds: bool = False,
) -> tuple[fx.GraphModule, list[Region]]:
    """Replace each marked region by a call to its compiled form. Regions the ``aten`` executor takes
    stay as they are (their ops already are ATen calls). Returns the new module and the regions.
    ``wait_for_builds``: finish every build before returning, so that ``record`` is complete now (a
    graph loaded from the graph cache: its kernels are in the kernel cache, there is nothing to wait for)."""
    if not any(REGION_KEY in n.meta for n in gm.graph.nodes):
        return gm, []
    from accelrun.compile.extract import extract_regions, replace_regions

    lowering = _Lowering(executors, cache_dir, strict, _Fallbacks(record, graph_name, strict))
    regions = extract_regions(gm, graph_kind)
    for region in regions:
        region.graph_kind = graph_kind
    compiled = lowering.run(regions)
    for region in regions:
        _note(record, graph_name, region, pending=isinstance(compiled.get(region.id), PendingBuild))
    by_id = {r.id: r for r in regions}
    compiled = {rid: FirstCallCheck(fn, by_id[rid], lowering) for rid, fn in compiled.items()}
    if wait_for_builds:
        for check in compiled.values():
            check.finish_build()
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
            for row in self._rows(region):
                row.declined[executor] = f"{stage}: {reason}"
                row.executor = to
                row.runtime_rows = row.runtime_rows and _reads_row_counts(to)

    def built(self, region: Region) -> None:
        """A pending build finished: its row gets the compile time and whether the cache supplied it."""
        if self.record is None:
            return
        for row in self._rows(region):
            row.compile_s, row.cache_hit = round(region.lowering.compile_s, 4), region.lowering.cache_hit
        _count_cache_use(self.record, region.lowering.cache_hit)

    def _rows(self, region: Region) -> list[RegionRecord]:
        assert self.record is not None
        return [r for r in self.record.regions if r.graph == self.graph and r.region == region.id]


class _Lowering:
    def __init__(self, executors: list[Executor], cache_dir: str, strict: bool = False,
                 fallbacks: _Fallbacks | None = None) -> None:  # fmt: skip
        self.executors = executors
        self.cache_dir = cache_dir
        self.unavailable = {e.name: e.unavailable_reason() for e in executors}
        self.fallbacks = fallbacks or _Fallbacks(None, "?", strict)

    def run(self, regions: list[Region]) -> dict[int, object]:
        """{region id: what runs it} for the regions an executor compiled; a ``parallel_compile``
        executor's come back as ``PendingBuild``s, their compilers still running."""
        compiled: dict[int, object] = {}
        claims = {r.id: self._claim(r, 0) for r in regions}
        by_id = {r.id: r for r in regions}
        pending: dict[int, tuple[Future, tuple | None]] = {}
        for job in self._compile_jobs(regions, claims):
            future = _build_pool().submit(job.run)
            forms = job.saved_forms or [None] * len(job.regions)
            pending.update({r.id: (future, form) for r, form in zip(job.regions, forms, strict=True)})
        self._build_ahead(regions, claims)
        for rid, index in claims.items():
            region = by_id[rid]
            if rid in pending:  # placed now; whether it compiled is known at its first call
                region.lowering.executor = self.executors[index].name
                compiled[rid] = PendingBuild(*pending[rid], region, index, self)
                continue
            while index is not None:
                fn, error, seconds = self._compile(region, index)
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

    def _compile_jobs(self, regions: list[Region], claims: dict[int, int | None]) -> list[_CompileJob]:
        """What runs on the build pool: for each ``parallel_compile`` executor, one job for all its
        regions when it has ``batch_compile`` (a lone region too: a batch knows what it will pickle as
        before it is built, so saving the graph does not wait for g++), else a job per region."""
        jobs = []
        for index, executor in enumerate(self.executors):
            mine = [r for r in regions if claims[r.id] == index]
            if not mine or not executor.parallel_compile:
                continue
            if executor.batch_compile:
                try:
                    forms = executor.saved_forms(mine, f"{self.cache_dir}/{executor.name}")
                except Exception:  # noqa: BLE001 (then pickling them waits for their build)
                    forms = None
                jobs.append(_CompileJob(mine, functools.partial(self._compile_batch, mine, index), forms))
            else:
                jobs += [_CompileJob([r], functools.partial(self._compile_alone, r, index)) for r in mine]
        return jobs

    def _build_ahead(self, regions: list[Region], claims: dict[int, int | None]) -> None:
        """Each executor compiled here, one region at a time, gets all its claimed regions first
        (``Executor.build_ahead``); a failure there only loses the head start."""
        for index, executor in enumerate(self.executors):
            mine = [r for r in regions if claims[r.id] == index]
            if len(mine) < 2 or executor.parallel_compile or executor.keeps_aten_ops:
                continue
            try:
                executor.build_ahead(mine, f"{self.cache_dir}/{executor.name}")
            except Exception:  # noqa: BLE001  (each region's own compile meets it again, with its reason)
                pass

    def _compile_alone(self, region: Region, index: int) -> dict[int, tuple[object | None, str | None, float]]:
        return {region.id: self._compile(region, index)}

    def _compile_batch(self, regions: list[Region], index: int) -> dict[int, tuple[object | None, str | None, float]]:
        """On a build thread: the batch, or each region alone if the batch fails (so that only a region
        at fault declines)."""
        ex = self.executors[index]
        t0 = time.perf_counter()
        try:
            fns = ex.compile_batch(regions, f"{self.cache_dir}/{ex.name}")
            share = (time.perf_counter() - t0) / len(regions)  # one build: each region's share of it
            return {r.id: _checked_at_build(r, fn, share) for r, fn in zip(regions, fns, strict=True)}
        except Exception:  # noqa: BLE001
            return {r.id: self._compile(r, index) for r in regions}

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
        return _checked_at_build(region, fn, time.perf_counter() - t0)

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


_pool: ThreadPoolExecutor | None = None


def _build_pool() -> ThreadPoolExecutor:
    """Threads that wait on compilers (g++): one per core, shared by every lowering in the process."""
    global _pool
    if _pool is None:
        # The creating thread (the one that trains) settles its own thread count first: a thread's
        # count is read from torch's process-wide setting at its first use, which a starting build
        # thread sets to 1 for a moment (``_one_openmp_thread``).
        torch.get_num_threads()
        _pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="accelrun-build",
                                   initializer=_one_openmp_thread)  # fmt: skip
    return _pool


_one_thread_lock = threading.Lock()


def _one_openmp_thread() -> None:
    """A build thread runs what it built once (``_checked_at_build``): ATen's ops and the kernels, which
    start OpenMP teams of torch's thread count. A team started from a thread lives as long as that
    thread, and this pool's live for the process: libgomp then manages more threads than there are
    cores and stops letting its idle threads spin, so every parallel region of the training thread
    (each kernel, each ATen op) waits for its threads to be woken. A 20 us kernel took 45-60 us, and
    transformers' Llama on changing lengths 6% longer a step (2026-12-06). One thread each, the
    build threads start no team.

    torch's ``set_num_threads`` also sets the count every thread takes at its first ATen call, so a
    short-lived thread puts that back (a thread started later, a user's or torch's, keeps torch's
    count); the lock keeps a second build thread from reading the 1 meanwhile."""
    with _one_thread_lock:
        count = torch.get_num_threads()  # this thread's first ATen call: the count threads start with
        torch.set_num_threads(1)
        restore = threading.Thread(target=torch.set_num_threads, args=(count,), name="accelrun-thread-count")
        restore.start()
        restore.join()


def _forget_pool_after_fork() -> None:  # a forked child has none of the parent's threads (nor their locks)
    global _pool, _finishing
    _pool, _finishing = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


@dataclass
class _CompileJob:
    regions: list[Region]
    run: Callable[[], dict[int, tuple[object | None, str | None, float]]]  # {region id: (fn, error, seconds)}
    saved_forms: list[tuple] | None = None  # each region's pickled form, known before the build runs


_finishing = threading.Lock()


def _checked_at_build(region: Region, fn: object, seconds: float) -> tuple[object | None, str | None, float]:
    """(fn, None, seconds), or the reason the built region is not used: kernels that read a length at
    each call were written from long probe lengths and are run once at short ones against the region's
    own ops (``codegen.short_lengths``). Here, on the build thread, before anything runs or is saved."""
    check = getattr(fn, "differs_at_short_lengths", None)
    try:
        problem = check(region) if check is not None else None
    except Exception as e:  # noqa: BLE001 (a check that cannot run is no pass)
        problem = f"the check at short lengths raised {one_line(e)}"
    return (fn, None, seconds) if problem is None else (None, f"compile failed: {problem}", seconds)


class PendingBuild:
    """A region whose compiler is still running on the build pool. The lowering does not wait for it:
    g++ runs beside what comes next (AOTAutograd's backward graph and its passes, the step's first ops),
    and the region's first call takes the result (``FirstCallCheck``), so a cold start waits only for
    builds that are not done by the time their code is needed. Where the executor knows what the region
    will pickle as (``saved_forms``: a library's path is its source's hash), the graph cache saves the
    graph without waiting either."""

    def __init__(self, future: Future, saved_form: tuple | None, region: Region, index: int,
                 lowering: _Lowering) -> None:  # fmt: skip
        self.future, self.saved_form, self.region, self.index = future, saved_form, region, index
        self.lowering, self.pid = lowering, os.getpid()

    def outcome(self) -> tuple[object | None, str | None, float]:
        """(fn, error, seconds), waiting for the build if need be."""
        if os.getpid() != self.pid:  # a forked child: the parent's build threads are not here
            return self.lowering._compile(self.region, self.index)
        try:
            if self.future.done():
                got = self.future.result().get(self.region.id)
            else:  # a wait the compile's progress line covers (a long g++ build)
                with ACTIVITY.compiling(f"the region kernels' build (g++), region {self.region.id} waited for"):
                    got = self.future.result().get(self.region.id)
        except Exception as e:  # noqa: BLE001 (a bug in the job itself: the region declines, the run goes on)
            return None, f"compile failed: {one_line(e)}", 0.0
        return got if got is not None else (None, "compile failed: the build returned nothing for it", 0.0)


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
        self.finish_build()
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

    def finish_build(self) -> None:
        """Wait for a pending build (if any); a compile that failed hands the region to the next executor."""
        with _finishing:  # two threads' first calls at once: one finishes it, the other then finds it done
            self._finish_build()

    def _finish_build(self) -> None:
        build = self.fn
        if not isinstance(build, PendingBuild):
            return
        fn, error, seconds = build.outcome()
        if error is None:
            self.fn = fn
            self.region.lowering.compile_s = seconds
            self.lowering.fallbacks.built(self.region)
            return
        self.region.lowering.declined[self.runner.name] = error
        runner, fn = self.lowering.next_after(self.region, self.runner)
        self.lowering.fallbacks("compile", self.region, self.runner.name, error, to=runner.name)
        self.runner, self.fn = runner, (_as_tuple(fn) if runner.keeps_aten_ops else fn)

    def __reduce__(self):
        # The graph cache saves what runs (a CppRegion pickles as its library's path), a pending build
        # what it will be once built, where that is known: saving then does not wait for g++.
        if isinstance(self.fn, PendingBuild) and self.fn.saved_form is not None:
            return self.fn.saved_form
        self.finish_build()
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


def _note(record: CompileRecord, graph: str, region: Region, pending: bool = False) -> None:
    """The region's row in the record; a pending build's compile time and cache use are filled in when
    it finishes (``_Fallbacks.built``)."""
    done = region.lowering
    record.regions.append(RegionRecord(
        graph=graph, region=region.id, ops=region.ops, executor=done.executor or AtenExecutor.name,
        declined=dict(done.declined), compile_s=0.0 if pending else round(done.compile_s, 4),
        cache_hit=None if pending else done.cache_hit, runtime_rows=_reads_rows_per_call(region),
    ))  # fmt: skip
    if not pending:
        _count_cache_use(record, done.cache_hit)


def _reads_rows_per_call(region: Region) -> bool:
    """The executor that claimed the region runs its program's kernels with the call's row count
    (codegen.runtime_rows): known at the claim, before a build finishes (the graph cache saves the
    region's record then)."""
    program = region.program
    return _reads_row_counts(region.lowering.executor) and program is not None and (
        program.runtime_rows is not None or program.linear_sizes is not None)


def _reads_row_counts(executor: str | None) -> bool:
    """Whether the named executor's kernels can take their row count at each call."""
    return bool(getattr(registered_executors().get(executor or ""), "runtime_rows", False))


def _count_cache_use(record: CompileRecord, cache_hit: bool | None) -> None:
    if cache_hit is True:
        record.cache_hits += 1
    elif cache_hit is False:
        record.cache_misses += 1

"""What the compiler did, for `accelrun compile explain` and the run report's compile section."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

from accelrun.compile.cuda_graph_policy import CudaGraphMode, CudaGraphsReport


@dataclass
class PassRecord:
    graph: str  # "g0.forward"
    stage: str
    name: str
    ops_before: int
    ops_after: int
    summary: str
    counts: dict[str, int]
    seconds: float
    detail: str = ""  # PassResult.detail: several lines, shown by `compile explain`
    numerics: str = ""  # compile.debug_numerics: what comparing the graph before and after said ("" unchecked)


NUMERICS_EQUAL = "equal before and after"  # PassRecord.numerics of a pass compile.debug_numerics found exact
LEFT_TO_ATEN = "left to ATen: "  # a pass's count of calls it left to ATen for one reason (the rest of the key)


@dataclass
class RegionRecord:
    graph: str
    region: int
    ops: list[str]
    executor: str
    declined: dict[str, str]  # executor → why it did not take the region
    compile_s: float
    cache_hit: bool | None = None
    # Its kernels read a changing size at each call, without a graph per size: a row count (a mixture's
    # tokens per expert, codegen.runtime_rows) or a length anywhere in the sizes (codegen.linear_sizes).
    runtime_rows: bool = False


@dataclass
class GraphRecord:
    name: str  # "g0.forward"
    ops: int  # call_function nodes after the passes
    collectives: dict[str, int]  # functional collectives seen, by op
    left_to_aten: int  # ops outside any region that compute (matmuls, attention, ...; views not counted)
    # Calls that draw dropout's numbers with accelrun's generator (fused/dropout.py), not ATen's: its
    # masks are not eager's, so a run's losses part from an eager run's (accelrun compare says why).
    dropout_draws: int = 0
    # compile.debug_numerics: the lowered graph (regions run by their executors' kernels) against the
    # graph before lowering, on the same inputs and random draws; "" where not compared
    lowering_numerics: str = ""


@dataclass
class Fallback:
    graph: str  # "g0.forward"
    stage: str  # pass | claim | compile | first call
    what: str  # the pass's name, or "region 3: cpp → aten"
    reason: str  # the exception, one line

    def line(self) -> str:
        return f"{self.graph} {self.stage} {self.what}: {self.reason}"


@dataclass
class SavedNotes:
    """What compiling one graph put in the record, saved with the graph by the graph cache and added to
    the record of a process that loads it, so that its report says what the compile did: the graph,
    its regions, and the passes and fallbacks since the graph before it of the same Dynamo graph."""

    regions: list[RegionRecord]
    graph: GraphRecord
    passes: list[PassRecord]
    fallbacks: list[Fallback]

    def add_to(self, record: CompileRecord, regions_lowered_again: bool) -> None:
        """Into ``record``: the graph and what its passes did (no time spent: this process ran none), and,
        unless it lowers the graph again itself (which records its regions and their fallbacks), its
        regions, each from its executor's cache now, and the lowering's fallbacks."""
        record.graphs.append(self.graph)
        record.passes += [replace(p, seconds=0.0) for p in self.passes]
        record.fallbacks += [f for f in self.fallbacks if f.stage == "pass" or not regions_lowered_again]
        if regions_lowered_again:
            return
        # (the notes were pickled perhaps before a region's build finished: its own cache_hit may be None)
        compiled = [r.executor != "aten" for r in self.regions]
        record.regions += [replace(r, compile_s=0.0, cache_hit=True if c else None)
                           for r, c in zip(self.regions, compiled, strict=True)]  # fmt: skip
        record.cache_hits += sum(compiled)


class RecordMark(NamedTuple):
    """How many of each a CompileRecord held at one moment (``CompileRecord.mark``)."""

    passes: int
    regions: int
    graphs: int
    fallbacks: int
    dynamo_graphs: int
    cache_hits: int
    cache_misses: int


@dataclass
class CompileRecord:
    passes: list[PassRecord] = field(default_factory=list)
    regions: list[RegionRecord] = field(default_factory=list)
    graphs: list[GraphRecord] = field(default_factory=list)
    stage_seconds: Counter = field(default_factory=Counter)
    graph_breaks: dict[str, int] = field(default_factory=dict)
    cache_hits: int = 0
    cache_misses: int = 0
    dynamo_graphs: int = 0  # graphs Dynamo handed the backend (one per distinct block code, loss head, ...)
    # Dynamo graph name -> the function it was traced from ("g0": "Block.forward (model.py:12)"), for
    # `compile explain`, whose graphs are otherwise only numbered
    traced_functions: dict[str, str] = field(default_factory=dict)
    # function label -> the compiles of its frame after Dynamo's first (its guards refused later inputs)
    recompiles: Counter = field(default_factory=Counter)
    # graph_cache.py: loaded / compiled / saved entries, fallbacks, errors; or {"off": why}
    # (load time is in stage_seconds["graph cache load"])
    graph_cache: dict[str, Any] = field(default_factory=dict)
    # Every time the compiler gave something up instead of stopping the run: a pass skipped for a graph,
    # a region sent to the next executor because compiling it, claiming it or its first call raised.
    fallbacks: list[Fallback] = field(default_factory=list)
    # What Dynamo did not hand us (coverage.py): frames seen and compiled, frames skipped with why.
    dynamo: dict[str, Any] = field(default_factory=dict)
    dynamo_start: dict[str, Any] = field(default_factory=dict, repr=False)  # coverage.snapshot() at the start
    # compile_model's first-call fallback: the whole forward was skipped, so smaller modules compiled
    fallback_scope: str = ""
    # ids of the parameters Dynamo handed this process's graphs as inputs: which modules a graph break
    # left out of every graph (compile_model's first-call fallback). Not saved.
    parameters_in_graphs: set[int] = field(default_factory=set, repr=False)
    # compile.cuda_graphs: the run's decision (set by dist.layout), captures, and graphs left out with why
    cuda_graphs: CudaGraphsReport = field(default_factory=CudaGraphsReport)

    def refresh_dynamo(self) -> None:
        """Graph breaks and frame coverage since ``dynamo_start`` (Dynamo counts them process-wide)."""
        if not self.dynamo_start:
            return
        from accelrun.compile.coverage import dynamo_coverage, graph_breaks_since

        self.dynamo = dynamo_coverage(self.dynamo_start)
        self.graph_breaks = graph_breaks_since(self.dynamo_start, self.dynamo)
        # Torch's precompile path (aot_compile) and a loaded entry go around Dynamo's frame counters:
        # without these a report said "frames seen / compiled 0 / 0" beside "graphs compiled 2".
        if via_cache := int(self.graph_cache.get("compiled", 0) or 0) + self.graphs_loaded():
            self.dynamo["frames_seen"] += via_cache
            self.dynamo["frames_compiled"] += via_cache
            self.dynamo["frames_via_graph_cache"] = via_cache

    def graphs_loaded(self) -> int:
        """Graphs this process took from the cross-process graph cache (compiled by an earlier one)."""
        return int(self.graph_cache.get("loaded", 0) or 0)

    def graphs_in_use(self) -> int:
        """Compiled graphs this process runs: traced here, or loaded from the graph cache (a loaded
        graph never reaches the backend, so ``dynamo_graphs`` does not count it)."""
        return self.dynamo_graphs + self.graphs_loaded()

    def compiled_line(self) -> str:
        """What ran compiled, in one line for the terminal: graphs, regions by executor, fallbacks."""
        loaded = self.graphs_loaded()
        n = self.graphs_in_use()
        graphs = f"{n} graph{'s' if n != 1 else ''}"
        if loaded:
            graphs += f" ({loaded} loaded from cache)" if loaded < n else " (loaded from cache)"
        per = self.regions_per_executor()
        regions = (f"{sum(per.values())} fusion regions ({', '.join(f'{k} {v}' for k, v in sorted(per.items()))})"
                   if per else "no fusion regions")  # fmt: skip
        parts = [graphs, regions]
        if self.fallbacks:
            parts.append(f"{len(self.fallbacks)} fallback(s)")
        if self.graph_breaks:
            parts.append(f"{sum(self.graph_breaks.values())} graph break(s)")
        if self.fallback_scope:
            parts.append(self.fallback_scope)
        if line := self.cuda_graphs.line():
            parts.append(line)
        if recompiled := self.recompiled():
            label, _ = max(recompiled.items(), key=lambda kv: kv[1])
            n = sum(recompiled.values())
            parts.append(f"{n} recompile{'s' if n != 1 else ''} ({label}: Dynamo's guards refused its graph for "
                         "later inputs; TORCH_LOGS=recompiles names the guard)")
        if line := self.numerics_line():
            parts.append(line)
        if changed := self.graph_cache.get("state_changed"):
            parts.append(f"not from the graph cache, which holds these graphs for {changed[0]} "
                         "(each setting keeps its own; these are saved now too)")
        return ", ".join(parts)

    def recompiled(self) -> dict[str, int]:
        """Functions Dynamo compiled again, with how many times: their earlier graph's guards refused later
        inputs (a new shape, dtype or value read from a tensor). Hidden before (a trial's)."""
        return dict(self.recompiles)

    def numerics_line(self) -> str:
        """compile.debug_numerics: how many passes' graphs compared equal to their input, and how many could
        not be compared; "" where nothing was compared (the option off, or every graph loaded from cache)."""
        said = [p.numerics for p in self.passes if p.numerics]
        lowered = [g.lowering_numerics for g in self.graphs if g.lowering_numerics]
        if not said and not lowered:
            return ""
        equal = sum(1 for s in said if s == NUMERICS_EQUAL)
        kernels = sum(1 for s in lowered if s == NUMERICS_EQUAL)
        return (f"debug_numerics: {equal} pass run(s) and {kernels} lowered graph(s) equal before and after"
                + (f", {len(said) + len(lowered) - equal - kernels} not compared (a pass that changes the random draws, or a graph that does not run on sample values)"
                   if len(said) + len(lowered) > equal + kernels else ""))

    def mark(self) -> RecordMark:
        """Where the record stands now, for ``roll_back``."""
        return RecordMark(len(self.passes), len(self.regions), len(self.graphs), len(self.fallbacks),
                          self.dynamo_graphs, self.cache_hits, self.cache_misses)  # fmt: skip

    def roll_back(self, mark: RecordMark) -> None:
        """Forget the graphs, regions, passes and fallbacks recorded since ``mark``: a precompile that
        torch refused after the backend had compiled (an unserializable guard) runs none of them, and
        the torch.compile fallback records its own. The time spent stays in ``stage_seconds``."""
        del self.passes[mark.passes:], self.regions[mark.regions:], self.graphs[mark.graphs:]
        del self.fallbacks[mark.fallbacks:]
        for name in [g for g in self.traced_functions if g[1:].isdigit() and int(g[1:]) >= mark.dynamo_graphs]:
            del self.traced_functions[name]  # ("g3": named by its number, which the next graph takes)
        self.dynamo_graphs, self.cache_hits, self.cache_misses = mark.dynamo_graphs, mark.cache_hits, mark.cache_misses

    def absorb(self, part: CompileRecord) -> None:
        """Add what ``part`` recorded (a graph-cache load, kept apart until its guards accepted the
        inputs: a rejected load is compiled afresh, and its regions must not be counted twice)."""
        self.passes += part.passes
        self.regions += part.regions
        self.graphs += part.graphs
        self.fallbacks += part.fallbacks
        self.stage_seconds.update(part.stage_seconds)
        self.cache_hits += part.cache_hits
        self.cache_misses += part.cache_misses

    def regions_per_executor(self) -> dict[str, int]:
        return dict(Counter(r.executor for r in self.regions))

    def regions_left_to_aten(self) -> list[str]:
        """One line per region that ran as its own ATen ops because every code generator in
        compile.executors declined it, with their reasons (not counted as fallbacks: nothing failed)."""
        return [f"{r.graph} region {r.region} ({len(r.ops)} ops: {', '.join(r.ops[:3])}"
                f"{', ...' if len(r.ops) > 3 else ''}): " + "; ".join(f"{k}: {v}" for k, v in r.declined.items())
                for r in self.regions if r.executor == "aten" and r.declined]

    def attention_left_to_aten(self) -> dict[str, int]:
        """Attention calls the cpu_attention pass left to ATen, by reason, over every graph it ran on."""
        out: Counter[str] = Counter()
        for p in self.passes:
            if p.name == "cpu_attention":
                out.update({k.removeprefix(LEFT_TO_ATEN): v for k, v in p.counts.items() if k.startswith(LEFT_TO_ATEN)})
        return dict(out)

    def passes_fired(self) -> dict[str, int]:
        """Pass name → number of graphs it changed."""
        return dict(Counter(p.name for p in self.passes if p.ops_before != p.ops_after or p.counts.get("changed")))

    def summary(self) -> dict[str, Any]:
        """The report's compile section (JSON-ready)."""
        self.refresh_dynamo()
        return {
            "dynamo_graphs": self.dynamo_graphs,
            "graphs_loaded": self.graphs_loaded(),
            "graphs_in_use": self.graphs_in_use(),
            "compiled": self.compiled_line(),
            "graph_breaks": sum(self.graph_breaks.values()),
            "graph_break_reasons": self.graph_breaks,
            "stage_seconds": {k: round(v, 3) for k, v in self.stage_seconds.items()},
            "cache": {"hits": self.cache_hits, "misses": self.cache_misses},
            "graph_cache": dict(self.graph_cache),
            "passes_fired": self.passes_fired(),
            "regions_per_executor": self.regions_per_executor(),
            "regions_left_to_aten": self.regions_left_to_aten(),
            "regions_with_runtime_rows": sum(r.runtime_rows for r in self.regions),
            "attention_left_to_aten": self.attention_left_to_aten(),
            "ops_left_to_aten": sum(g.left_to_aten for g in self.graphs),
            "dropout_in_kernels": sum(g.dropout_draws for g in self.graphs),
            "fallbacks": [f.line() for f in self.fallbacks],
            "dynamo": dict(self.dynamo),
            "cuda_graphs": self.cuda_graphs.summary(),
            "warnings": self.warnings(),
        }

    def warnings(self) -> list[str]:
        """What a user must not miss: the model (or part of it) ran uncompiled, or the compiler fell back."""
        from accelrun.compile.coverage import coverage_warnings

        out = coverage_warnings(self)
        if self.fallbacks:
            out.append(f"the compiler fell back {len(self.fallbacks)} time(s) (a pass skipped, a region left to "
                       f"a later executor): first {self.fallbacks[0].line()}")
        graphs = self.cuda_graphs
        if graphs.mode is CudaGraphMode.ON and not graphs.run.use:
            out.append(f"compile.cuda_graphs = on, but they do not apply to this run: {graphs.run.reason}")
        elif graphs.mode is CudaGraphMode.ON and graphs.declined:
            why = "; ".join(f"{k}: {v}" for k, v in graphs.declined.items())
            out.append(f"compile.cuda_graphs = on, but {len(graphs.declined)} graph(s) run without: {why}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "passes": [asdict(p) for p in self.passes],
            "regions": [asdict(r) for r in self.regions],
            "graphs": [asdict(g) for g in self.graphs],
            "fallbacks": [asdict(f) for f in self.fallbacks],
            "traced_functions": self.traced_functions,
        }


def merge_records(parts: list[tuple[str, CompileRecord]]) -> CompileRecord:
    """One record for the parts of a model that separate backends compiled in one process (a rank's
    pipeline stages): each graph named after its part (``"stage2.g0.forward"``), counts and seconds
    summed. Call it when reading: the parts compile lazily, inside the first step."""
    if len(parts) == 1:
        return parts[0][1]
    out = CompileRecord()
    # Dynamo's counters are process-wide: read once, since the first part's backend was made (the
    # earliest snapshot), not per part, which would count every graph break once for each part.
    out.dynamo_start = parts[0][1].dynamo_start if parts else {}
    for label, rec in parts:
        out.passes += [replace(p, graph=f"{label}.{p.graph}") for p in rec.passes]
        out.regions += [replace(r, graph=f"{label}.{r.graph}") for r in rec.regions]
        out.graphs += [replace(g, name=f"{label}.{g.name}") for g in rec.graphs]
        out.fallbacks += [replace(f, graph=f"{label}.{f.graph}") for f in rec.fallbacks]
        out.traced_functions |= {f"{label}.{g}": fn for g, fn in rec.traced_functions.items()}
        out.stage_seconds.update(rec.stage_seconds)
        out.cache_hits += rec.cache_hits
        out.cache_misses += rec.cache_misses
        out.dynamo_graphs += rec.dynamo_graphs
        out.recompiles.update({f"{label}: {fn}": n for fn, n in rec.recompiles.items()})
        out.graph_cache = _merge_stats(out.graph_cache, rec.graph_cache)
        if rec.cuda_graphs.mode is not CudaGraphMode.OFF:  # every part has the run's decision; graphs by part
            out.cuda_graphs.mode, out.cuda_graphs.run = rec.cuda_graphs.mode, rec.cuda_graphs.run
            out.cuda_graphs.replays += rec.cuda_graphs.replays
            out.cuda_graphs.captured |= {f"{label}.{k}": v for k, v in rec.cuda_graphs.captured.items()}
            out.cuda_graphs.declined |= {f"{label}.{k}": v for k, v in rec.cuda_graphs.declined.items()}
        if rec.fallback_scope:
            out.fallback_scope = "; ".join(filter(None, [out.fallback_scope, f"{label}: {rec.fallback_scope}"]))
    return out


def _merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """graph_cache's stats of two parts: counts summed, error lists joined, an "off" reason kept once."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = list(value) if isinstance(value, list) else value
        elif isinstance(value, int) and isinstance(out[key], int):
            out[key] += value
        elif isinstance(value, list):
            out[key] = [*out[key], *value]
        elif value != out[key]:
            out[key] = f"{out[key]}; {value}"
    return out

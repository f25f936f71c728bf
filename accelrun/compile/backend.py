"""The torch.compile backend: Dynamo graph → pre-grad passes → AOTAutograd (core ATen decompositions,
accelrun's partitioner) → post-grad passes on the forward and backward graphs → fusion regions lowered
to executors.

    backend = AccelrunBackend(CompileOptions())
    block.compile(backend=backend)
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from functools import partial
from typing import Any

from torch import fx

from accelrun.compile import coverage
from accelrun.compile.cuda_graphs import with_cuda_graphs
from accelrun.compile.dump import Dumper
from accelrun.compile.fast_calls import runnable
from accelrun.compile.lower import CompilerFallbackError, lower_regions, make_executors, one_line
from accelrun.compile.numerics import check_pass
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import ConfiguredPass, GraphNotes, PassContext, lint, passes_for_stage
from accelrun.compile.record import CompileRecord, Fallback, GraphRecord, PassRecord
from accelrun.compile.regions import REGION_KEY
from accelrun.torch_private import aot_module_simplified, default_partition, make_boxed_func


def decompositions() -> dict:
    """Core ATen decompositions, except attention: a fused attention kernel is worth more than its parts."""
    from accelrun.torch_private import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items() if "attention" not in op.name()}


def graph_snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph (nodes and their meta dicts copied, values shared) to go back to if a
    pass that rewrites in place raises half way. Far cheaper than a deepcopy of the fake tensors."""
    graph = fx.Graph()
    # Not a deepcopy: that rebuilds the pytree specs' LeafSpecs, which torch deprecates with a FutureWarning
    # printed on every compiled run. The specs are frozen, so sharing them is safe; only the list is copied.
    graph._codegen = copy.copy(gm.graph._codegen)
    if (info := getattr(graph._codegen, "pytree_info", None)) is not None:
        graph._codegen.pytree_info = info._replace(orig_args=list(info.orig_args))
    value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(value).meta = copy.copy(old_output.meta)
    snap = fx.GraphModule(gm, graph)
    snap.meta = dict(getattr(gm, "meta", {}))
    return snap


def count_ops(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def collectives_in(gm: fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and "_c10d_functional" in str(n.target):
            name = str(n.target).split(".")[-2] if "." in str(n.target) else str(n.target)
            out[name] = out.get(name, 0) + 1
    return out


class AccelrunBackend:
    """A torch.compile backend. One instance per compiled model; ``record`` accumulates what it did."""

    def __init__(self, options: CompileOptions | None = None, record: CompileRecord | None = None) -> None:
        self.options = options or CompileOptions()
        self.record = record or CompileRecord()
        self.dump = Dumper(self.options.dump_dir)
        self.executors = make_executors(self.options.executors)
        if not self.record.dynamo_start:
            self.record.dynamo_start = coverage.snapshot()
        self._inside = 0.0  # seconds spent in our own hooks during the current AOTAutograd call
        # Set by graph_cache while it precompiles: graphs then come back as AccelrunOutputCode, which
        # torch's precompile path can save with the Dynamo frame and load in another process.
        self.serializable = False

    # -- entry point -------------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]):
        name = f"g{self.record.dynamo_graphs}"
        self.record.dynamo_graphs += 1
        # One for this Dynamo graph, kept by every stage's closures below: AOTAutograd compiles the
        # backward lazily, long after this call returns, and it must see what the forward's passes noted.
        notes = GraphNotes()
        t0 = time.perf_counter()
        gm = self._run_passes("pre_grad", gm, f"{name}.pre_grad", "pre_grad", list(example_inputs), notes)
        t1 = time.perf_counter()
        self.record.stage_seconds["pre_grad passes"] += t1 - t0
        self._inside = 0.0
        compiled = aot_module_simplified(
            gm, example_inputs,
            fw_compiler=self._graph_compiler(name, "forward", notes),
            bw_compiler=self._graph_compiler(name, "backward", notes),
            inference_compiler=self._graph_compiler(name, "inference", notes),
            partition_fn=partial(self._partition, name, notes),
            decompositions=decompositions(),
        )  # fmt: skip
        self.record.stage_seconds["aot trace"] += time.perf_counter() - t1 - self._inside
        self.collect_graph_breaks()
        return compiled

    def collect_graph_breaks(self) -> dict[str, int]:
        """Graph breaks Dynamo counted since this backend was made, by reason (never hidden), and the
        frames it saw, compiled and skipped (``record.dynamo``)."""
        self.record.refresh_dynamo()
        return self.record.graph_breaks

    # -- stages ------------------------------------------------------------------------------------
    @contextmanager
    def _timed(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.record.stage_seconds[stage] += dt
            self._inside += dt

    def _partition(self, name: str, notes: GraphNotes, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        with self._timed("partition"):
            # AOTAutograd's own count: the joint and partition passes must not guess it from names.
            notes.num_fwd_outputs = kwargs.get("num_fwd_outputs")
            # The joint stage: before the cut decides what the forward saves for the backward.
            joint = self._run_passes("joint", joint, f"{name}.joint", "joint", None, notes)
            fw, bw = default_partition(joint, joint_inputs, **kwargs)
            for p in passes_for_stage(self.options.passes, "partition"):
                t0 = time.perf_counter()
                before = count_ops(fw) + count_ops(bw)
                saved = (graph_snapshot(fw), graph_snapshot(bw))
                try:
                    result = p.spec.fn((fw, bw), p.options, PassContext("joint", notes=notes))
                    if result.graph is not None:
                        fw, bw = result.graph
                    lint(fw), lint(bw)
                except Exception as e:
                    fw, bw = saved
                    self._pass_failed(f"{name}.joint", "partition", p, before, e, time.perf_counter() - t0)
                    continue
                self._note_pass(f"{name}.joint", "partition", p, before, count_ops(fw) + count_ops(bw), result,
                                time.perf_counter() - t0)  # fmt: skip
                self.dump.graph(f"{name}.forward", f"partition_{p.name}", fw)
                self.dump.graph(f"{name}.backward", f"partition_{p.name}", bw)
            return fw, bw

    def _graph_compiler(self, name: str, kind: str, notes: GraphNotes):
        compile_graph = partial(self._compile_graph, name, kind, notes)
        if not self.serializable:
            return compile_graph
        from accelrun.compile.output_code import AccelrunOutputCode
        from accelrun.torch_private import SerializableAOTDispatchCompiler

        return SerializableAOTDispatchCompiler(AccelrunOutputCode, compile_graph)

    def _compile_graph(self, name: str, kind: str, notes: GraphNotes, gm: fx.GraphModule, example_inputs: list[Any]):
        graph_name = f"{name}.{kind}"
        with self._timed("post_grad passes"):
            gm = self._run_passes("post_grad", gm, graph_name, kind, list(example_inputs), notes)
        first_region = len(self.record.regions)
        with self._timed("lowering"):
            lowered, regions = lower_regions(gm, graph_name, kind, self.executors, self.record,
                                             str(self.options.cache_dir), self.options.strict)  # fmt: skip
            for region in regions:
                if "source" in region.facts:
                    ext = region.facts.get("source_ext", "txt")
                    self.dump.source(graph_name, f"region{region.id}_{region.facts['executor']}.{ext}",
                                     region.facts["source"])  # fmt: skip
            if lowered is not gm:
                self.dump.graph(graph_name, "lowered", lowered)
        self.record.graphs.append(GraphRecord(
            name=graph_name, ops=count_ops(gm), collectives=collectives_in(gm),
            left_to_aten=sum(1 for n in gm.graph.nodes if n.op == "call_function" and REGION_KEY not in n.meta),
        ))  # fmt: skip
        if self.serializable:
            from accelrun.compile.output_code import AccelrunOutputCode

            notes = (self.record.regions[first_region:], self.record.graphs[-1])
            code = AccelrunOutputCode(gm, lowered, graph_name, kind, [e.name for e in self.executors],
                                      str(self.options.cache_dir), notes)  # fmt: skip
            code.use_cuda_graphs(self.record, example_inputs)
            return code
        run = runnable(lowered, returns_gradients=kind == "backward")
        # compile.cuda_graphs: replayed as a CUDA graph where the run and this graph allow it.
        return make_boxed_func(with_cuda_graphs(run, graph_name, gm, example_inputs, self.record.cuda_graphs))

    def _run_passes(self, stage: str, gm: fx.GraphModule, graph_name: str, kind: str,
                    example_inputs: list[Any] | None, notes: GraphNotes | None = None) -> fx.GraphModule:  # fmt: skip
        self.dump.graph(graph_name, "input", gm)
        notes = notes if notes is not None else GraphNotes()
        for p in passes_for_stage(self.options.passes, stage):  # type: ignore[arg-type]
            # (a joint graph has no example inputs to check a pass's numerics with)
            before_copy = copy.deepcopy(gm) if self.options.debug_numerics and example_inputs is not None else None
            t0 = time.perf_counter()
            before = count_ops(gm)
            saved = graph_snapshot(gm)
            try:
                # The same notes for every pass: what one pass leaves (the next region id) the next reads.
                ctx = PassContext(kind, example_inputs, notes)  # type: ignore[arg-type]
                result = p.spec.fn(gm, p.options, ctx)
                if result.graph is not None:
                    gm = result.graph
                gm.recompile()
                try:
                    lint(gm)
                except Exception as e:
                    raise RuntimeError(f"pass {p.name!r} left a malformed graph in {graph_name}: {e}") from e
            except Exception as e:  # the graph as it was before the pass goes on; the run does not stop
                gm = saved
                self._pass_failed(graph_name, stage, p, before, e, time.perf_counter() - t0)
                continue
            self._note_pass(graph_name, stage, p, before, count_ops(gm), result, time.perf_counter() - t0)
            if before_copy is not None:
                check_pass(p.name, before_copy, gm, example_inputs)
            if result.changed:
                self.dump.graph(graph_name, p.name, gm)
        return gm

    def _pass_failed(self, graph: str, stage: str, p: ConfiguredPass, before: int, e: Exception,
                     seconds: float) -> None:  # fmt: skip
        reason = one_line(e)
        if self.options.strict:
            raise CompilerFallbackError(f"pass {p.name!r} failed on {graph}: {reason} (compile.strict is on)") from e
        self.record.fallbacks.append(Fallback(graph, "pass", p.name, f"{reason}; skipped for this graph"))
        self.record.passes.append(PassRecord(
            graph=graph, stage=stage, name=p.name, ops_before=before, ops_after=before,
            summary=f"FAILED, skipped for this graph: {reason}", counts={"failed": 1}, seconds=round(seconds, 4),
        ))  # fmt: skip

    def _note_pass(self, graph: str, stage: str, p: ConfiguredPass, before: int, after: int, result: Any,
                   seconds: float) -> None:  # fmt: skip
        counts = dict(result.counts)
        if result.changed:
            counts.setdefault("changed", 1)
        self.record.passes.append(PassRecord(
            graph=graph, stage=stage, name=p.name, ops_before=before, ops_after=after,
            summary=result.summary, counts=counts, seconds=round(seconds, 4), detail=result.detail,
        ))  # fmt: skip


def accelrun_backend(options: CompileOptions | None = None) -> AccelrunBackend:
    return AccelrunBackend(options)



def dynamo_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None) -> Any:
    """The backend by name, for any script: ``torch.compile(model, backend="accelrun")``, found through
    the ``torch_dynamo_backends`` entry point. ``options`` (torch.compile's) may set ``passes`` (a
    preset or a list), ``executors``, ``strict``, ``cache_dir``, ``dump_dir``::

        torch.compile(model, backend="accelrun", options={"passes": "max", "executors": ["cpp", "aten"]})
    """
    from pathlib import Path

    from accelrun.compile.passes.base import resolve_passes

    opts = dict(options or {})
    known = {"passes", "executors", "strict", "cache_dir", "dump_dir", "debug_numerics"}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"accelrun backend: unknown option(s) {unknown}; known: {', '.join(sorted(known))}")
    kwargs: dict[str, Any] = {}
    if "passes" in opts:
        kwargs["passes"] = resolve_passes(opts["passes"])
    for key in ("executors", "strict", "debug_numerics"):
        if key in opts:
            kwargs[key] = list(opts[key]) if key == "executors" else bool(opts[key])
    for key in ("cache_dir", "dump_dir"):
        if opts.get(key) is not None:
            kwargs[key] = Path(opts[key])
    return AccelrunBackend(CompileOptions(**kwargs))(gm, example_inputs)

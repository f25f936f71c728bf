"""The torch.compile backend: Dynamo graph → pre-grad passes → AOTAutograd (core ATen decompositions,
accelrun's partitioner) → post-grad passes on the forward and backward graphs → fusion regions lowered
to executors.

    backend = AccelrunBackend(CompileOptions())
    block.compile(backend=backend)
"""

from __future__ import annotations

import copy
import operator
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from functools import cache, partial
from typing import Any

import torch
from torch import fx, nn

from accelrun.compile import break_sites, coverage
from accelrun.compile.activity import ACTIVITY
from accelrun.compile.codegen.values import MARKED_DYNAMIC
from accelrun.compile.cuda_graphs import graph_facts, with_cuda_graphs
from accelrun.compile.dump import Dumper
from accelrun.compile.executors.generated import compiling_after
from accelrun.compile.fast_calls import runnable
from accelrun.compile.fused.attention import DRAWS_DROPOUT
from accelrun.compile.gc_pause import gc_paused
from accelrun.compile.lower import lower_regions, make_executors
from accelrun.compile.op_kinds import VIEW_OPS
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import GraphNotes
from accelrun.compile.pipeline import PassDriver, count_ops, graph_snapshot  # noqa: F401  (graph_snapshot re-exported)
from accelrun.compile.record import CompileRecord, GraphRecord, RecordMark, SavedNotes
from accelrun.compile.regions import REGION_KEY
from accelrun.torch_private import CompileContext, saved_tensors_hooks_paused


def computes_outside_regions(node: fx.Node) -> bool:
    """A call outside every region that does work: views and tuple reads are not counted (a compiler
    engineer's trial read 111 "ATen calls" of which a third were views and getitems)."""
    return (node.op == "call_function" and REGION_KEY not in node.meta and node.target not in VIEW_OPS
            and not getattr(node.target, "is_view", False) and node.target is not operator.getitem)


def decompositions() -> dict:
    """Core ATen decompositions, except attention: a fused attention kernel is worth more than its parts."""
    return dict(_decompositions())


@cache
def _decompositions() -> dict:  # torch builds its table anew on each call
    # Not torch.export's table (core_aten_decompositions), which adds an entry for every
    # CompositeImplicitAutograd op: 0.2-0.3 s of a cold start, and AOTAutograd's graphs come out the
    # same without them (tests/test_torch_private.py traces both).
    from accelrun.torch_private import core_aten_decompositions_post_autograd

    return {op: fn for op, fn in core_aten_decompositions_post_autograd().items() if "attention" not in op.name()}


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
        for executor in self.executors:  # compile.tune_launches, read by the Triton executor
            if hasattr(executor, "tune_launches"):
                executor.tune_launches = self.options.tune_launches
        self.passes = PassDriver(self.options.passes, self.record, self.dump, strict=self.options.strict,
                                 debug_numerics=self.options.debug_numerics)
        break_sites.listen()
        if not self.record.dynamo_start:
            self.record.dynamo_start = coverage.snapshot()
        self._inside = 0.0  # seconds spent in our own hooks during the current AOTAutograd call
        # Set by graph_cache while it precompiles: graphs then come back as AccelrunOutputCode, which
        # torch's precompile path can save with the Dynamo frame and load in another process.
        self.serializable = False
        self.precompiling = ""  # set by graph_cache with serializable: the function its precompile traces
        # Called on each forward/backward graph after its post-grad passes, before lowering (compiled FSDP
        # routes collectives through its communication trace here).
        self.before_lowering: list[Callable[[fx.GraphModule], None]] = []
        self._frame_compiles: dict[int, int] = {}  # Dynamo's frame id -> graphs compiled for it by this backend
        # Dynamo graph name -> where the record stood after the last of its graphs was saved: each saved
        # graph carries the pass records and fallbacks made since (SavedNotes), so a load reports what
        # the passes did (the attention they left to ATen, a pass that failed) as the compile did.
        self._saved_up_to: dict[str, RecordMark] = {}

    # -- entry point -------------------------------------------------------------------------------
    def before_tracing(self, module: nn.Module) -> None:
        """Start what can run beside Dynamo's trace of ``module`` (the graph cache calls this before it
        precompiles a method): the C++ attention kernel's build, when the passes hand attention to it."""
        if any(p.name == "cpu_attention" for p in self.options.passes):
            from accelrun.compile.passes.cpu_attention import build_kernel_early

            build_kernel_early(module)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]):
        with gc_paused(), self._counting_compiles():
            return self._compile_dynamo_graph(gm, example_inputs)

    def _counting_compiles(self):
        """How many graphs this backend compiled before for the frame Dynamo compiles now (read by the
        code generators, ``executors.generated.sizes_keep_changing``). The graph cache's precompile has no
        frame id: it says the count itself."""
        compile_id = CompileContext.current_compile_id()
        if compile_id is None or compile_id.frame_id is None:
            return nullcontext()
        # Dynamo's first compile of a frame is this backend's first too: after torch._dynamo.reset() frame
        # ids start from 0 again, and another frame's count was taken for a new model's (this backend
        # lives for the process when torch.compile names it).
        first = compile_id.frame_compile_id == 0
        count = 0 if first else self._frame_compiles.get(compile_id.frame_id, 0)
        self._frame_compiles[compile_id.frame_id] = count + 1
        return compiling_after(count)

    def _compile_dynamo_graph(self, gm: fx.GraphModule, example_inputs: list[Any]):
        from accelrun.torch_private import DynamoRestartAnalysis

        before = self.record.mark()
        compile_id = CompileContext.current_compile_id()
        marked = MARKED_DYNAMIC.set(sizes_marked_dynamic(gm))  # kept symbolic by the code generators
        try:
            compiled = self._compile_new_dynamo_graph(gm, example_inputs)
        except DynamoRestartAnalysis:
            # Dynamo traces the frame again and hands over the graph it keeps: the abandoned one is not a
            # graph in use (a trial's report counted 4 graphs for 3, one with pre-grad passes only), nor a
            # compile of its frame (the code generators count those: _counting_compiles).
            self.record.roll_back(before)
            if compile_id is not None and compile_id.frame_id in self._frame_compiles:
                self._frame_compiles[compile_id.frame_id] -= 1
            raise
        finally:
            MARKED_DYNAMIC.reset(marked)
        if compile_id is not None and (compile_id.frame_compile_id or 0) > 0:  # Dynamo compiles its frame again
            self.record.recompiles[self.record.traced_functions.get(f"g{before.dynamo_graphs}", "?")] += 1
        return compiled

    def _compile_new_dynamo_graph(self, gm: fx.GraphModule, example_inputs: list[Any]):
        name = f"g{self.record.dynamo_graphs}"
        self.record.dynamo_graphs += 1
        self.record.traced_functions[name] = break_sites.traced_function() or self.precompiling
        self.record.parameters_in_graphs.update(id(t) for t in example_inputs if isinstance(t, nn.Parameter))
        # One for this Dynamo graph, kept by every stage's closures below: the backward's compile must see
        # what the forward's passes noted (AOTAutograd calls it after the forward's, below).
        notes = GraphNotes()
        self._saved_up_to[name] = self.record.mark()
        ACTIVITY.doing(f"{name}: pre_grad passes")
        t0 = time.perf_counter()
        # The pre-grad passes give new nodes fake values by running their ops with grad (the values say
        # which need it): under non-reentrant torch.utils.checkpoint those saves reached its hooks, which
        # count every tensor its region saves, and the recomputation (nothing compiles there) failed with
        # "A different number of tensors was saved". Dynamo traces with the hooks paused; so do the passes.
        with saved_tensors_hooks_paused():
            gm = self.passes.run_graph("pre_grad", gm, f"{name}.pre_grad", "pre_grad", list(example_inputs), notes)
        t1 = time.perf_counter()
        self.record.stage_seconds["pre_grad passes"] += t1 - t0
        self._inside = 0.0
        ACTIVITY.doing(f"{name}: AOTAutograd traces the forward and backward")
        # The backward graph is lowered right after the forward, not at the first backward as AOTAutograd
        # would: its regions' g++ then runs while the forward's finishes and the forward runs, instead of
        # after the forward (transformers' Llama, a cold first step: 0.5 s the backward waited on g++).
        # torch's precompile path (the graph cache) sets the same. So a backward that cannot compile fails
        # at the forward's compile, and a graph whose backward never runs is lowered all the same.
        # AOTAutograd's graphs are made lazy: the partition and post_grad passes each rewrite them and
        # call recompile(), which then only marks them; their code is written once, after each stage.
        # Graphs printed for logs nobody reads: 35 ms of the debug Llama's cold step (torch_private).
        # AOTAutograd and its partitioner are imported here, not with this module: 0.3 s of a new
        # process that loads every graph from the graph cache and so never compiles.
        from accelrun.torch_private import (
            aot_module_simplified,
            functorch_config,
            no_donated_buffers,
            unread_compile_logs_skipped,
            use_lazy_graph_module,
        )

        # No donated buffers: they mark saved tensors the backward may reuse, which AOTAutograd drops for a
        # backward compiled lazily under retain_graph=True but refuses in one compiled with the forward
        # (every `backward(retain_graph=True)` failed: a trial's GAN-style and multi-loss steps). accelrun's
        # backward reuses none, so nothing is lost (pipelining's split backward set the same, dist/pipeline).
        with (functorch_config.patch(force_non_lazy_backward_lowering=True), no_donated_buffers(),
              use_lazy_graph_module(True), unread_compile_logs_skipped()):  # fmt: skip
            compiled = aot_module_simplified(
                gm, example_inputs,
                fw_compiler=self._graph_compiler(name, "forward", notes),
                bw_compiler=self._graph_compiler(name, "backward", notes),
                inference_compiler=self._graph_compiler(name, "inference", notes),
                partition_fn=partial(self._partition, name, notes),
                decompositions=decompositions(),
            )  # fmt: skip
        self.record.stage_seconds["aot trace"] += time.perf_counter() - t1 - self._inside
        ACTIVITY.tracing_again()  # Dynamo: its guards, and the frame's code after a graph break
        self.collect_graph_breaks()
        if self.serializable:  # precompiling for the graph cache: in the form torch saves with the frame
            from accelrun.compile.output_code import PrecompiledGraph

            return PrecompiledGraph(compiled)
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
            if (static := kwargs.get("static_lifetime_input_indices")) is not None:
                notes.static_inputs = frozenset(static)
            # The joint stage: before the cut decides what the forward saves for the backward.
            from accelrun.torch_private import default_partition

            joint = self.passes.run_graph("joint", joint, f"{name}.joint", "joint", None, notes,
                                          check_inputs=list(joint_inputs))
            fw, bw = default_partition(joint, joint_inputs, **kwargs)
            fw, bw = self.passes.run_pair(name, fw, bw, notes, joint, list(joint_inputs))
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
            gm = self.passes.run_graph("post_grad", gm, graph_name, kind, list(example_inputs), notes)
            for hook in self.before_lowering:
                hook(gm)
        first_region = len(self.record.regions)
        # compile.debug_numerics: the graph as the regions' kernels will run it, against the graph before
        needs_check = self.options.debug_numerics and example_inputs is not None
        before_lowering = copy.deepcopy(gm) if needs_check else None
        with self._timed("lowering"):
            ACTIVITY.doing(f"{graph_name}: lowering to {'/'.join(e.name for e in self.executors)} "
                           f"({count_ops(gm):,} ops)")
            lowered, regions = lower_regions(gm, graph_name, kind, self.executors, self.record,
                                             str(self.options.cache_dir), self.options.strict)  # fmt: skip
            for region in regions:  # the source of the generator that runs the region
                if (source := region.lowering.sources.get(region.lowering.executor or "")) is not None:
                    self.dump.source(graph_name, f"region{region.id}_{region.lowering.executor}.{source.ext}",
                                     source.text)  # fmt: skip
            if lowered is not gm:
                self.dump.graph(graph_name, "lowered", lowered)
        self.record.graphs.append(GraphRecord(
            name=graph_name, ops=count_ops(gm), collectives=collectives_in(gm),
            left_to_aten=sum(1 for n in gm.graph.nodes if computes_outside_regions(n)),
            dropout_draws=sum(1 for n in gm.graph.nodes if n.target in DRAWS_DROPOUT),
        ))  # fmt: skip
        if before_lowering is not None and lowered is not gm:
            from accelrun.compile.numerics import check_pass

            self.record.graphs[-1].lowering_numerics = check_pass(
                f"the lowering of {graph_name} (its regions' generated kernels)", before_lowering, lowered,
                list(example_inputs))
        if self.serializable:
            from accelrun.compile.output_code import AccelrunOutputCode

            since = self._saved_up_to[name]  # set when this Dynamo graph's compile began
            notes = SavedNotes(self.record.regions[first_region:], self.record.graphs[-1],
                               self.record.passes[since.passes:], self.record.fallbacks[since.fallbacks:])
            self._saved_up_to[name] = self.record.mark()
            code = AccelrunOutputCode(gm, lowered, graph_name, kind, [e.name for e in self.executors],
                                      str(self.options.cache_dir), notes, graph_facts(gm, example_inputs))  # fmt: skip
            code.use_cuda_graphs(self.record)
            return code
        from accelrun.torch_private import make_boxed_func

        run = runnable(lowered, returns_gradients=kind == "backward")
        # compile.cuda_graphs: replayed as a CUDA graph where the run and this graph allow it.
        return make_boxed_func(with_cuda_graphs(run, graph_name, gm, example_inputs, self.record.cuda_graphs))

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
    # One backend per set of options for the process, as torch.compile(model) gives one frame many graphs:
    # a backend made anew for each graph counted every frame's compiles from 0, so a model fed a new
    # length each call never got its graph for any size, and Dynamo's recompile limit (8) left it eager.
    key = repr(sorted(opts.items()))
    backend = _NAMED_BACKENDS.get(key)
    if backend is None:
        backend = _NAMED_BACKENDS[key] = AccelrunBackend(CompileOptions(**kwargs))
    return backend(gm, example_inputs)


_NAMED_BACKENDS: dict[str, AccelrunBackend] = {}  # dynamo_backend's, by its options


def sizes_marked_dynamic(gm: fx.GraphModule) -> frozenset:
    """The symbols of the sizes a user marked dynamic (``torch._dynamo.mark_dynamic``) among a Dynamo graph's
    inputs: the real tensor Dynamo holds for a placeholder carries the marked dimensions."""
    out = set()
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        real = getattr(node.meta.get("grapharg"), "example", None)
        value = node.meta.get("example_value")
        for dim in getattr(real, "_dynamo_dynamic_indices", ()) or ():
            size = value.shape[dim] if isinstance(value, torch.Tensor) and dim < value.dim() else None
            if isinstance(size, torch.SymInt):
                out |= size.node.expr.free_symbols
    return frozenset(out)

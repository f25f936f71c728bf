"""A compiled forward or backward graph that can be saved with its Dynamo frame and loaded in another
process (see ``graph_cache.py``).

Two forms are saved. The lowered graph itself, node by node (ATen ops by name, each compiled region
as its kernel's library path and buffer layout): loading it costs milliseconds. And, for when that
cannot be used (a region whose executor cannot be pickled, a library gone from the kernel cache), the
graph after accelrun's passes, before lowering: loading it lowers again, with kernels from the
executors' caches (rebuilt if they were wiped).
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

import accelrun.compile.fused.depthwise_conv  # noqa: F401  (registers the accelrun:: ops a saved graph may hold)
from accelrun.compile.cuda_graph_policy import CudaGraphsReport, GraphFacts
from accelrun.compile.cuda_graphs import CudaGraphRunner, shared_capture, wants_cuda_graphs
from accelrun.compile.fast_calls import STATIC_LAYOUTS, layouts_are_static, runnable
from accelrun.compile.gemm_choice import GemmSite
from accelrun.compile.record import CompileRecord, SavedNotes
from accelrun.torch_private import BundledAOTAutogradSerializableCallable, LazyGraphModule, OutputCode

# Where regions lowered while loading are recorded (the loading backend's record); None: nowhere.
_loading_record: ContextVar[CompileRecord | None] = ContextVar("accelrun_loading_record", default=None)


@contextmanager
def recording_loads_into(record: CompileRecord):
    token = _loading_record.set(record)
    try:
        yield
    finally:
        _loading_record.reset(token)


class AccelrunOutputCode(OutputCode):
    """Called with the graph's inputs as one list (the boxed convention AOTAutograd uses)."""

    def __init__(self, graph: fx.GraphModule, lowered: fx.GraphModule, graph_name: str, kind: str,
                 executors: list[str], cache_dir: str, notes: SavedNotes,
                 facts: GraphFacts) -> None:  # fmt: skip
        self._boxed_call = True
        self.graph_module: fx.GraphModule | None = graph
        self.lowered: fx.GraphModule | None = lowered
        self.graph_name, self.kind, self.executors, self.cache_dir = graph_name, kind, executors, cache_dir
        self.notes = notes  # what compiling it put in the record, added to a loading process's
        # Read from the example inputs when compiled, and saved: a load from torch's precompile passes
        # none (an empty list), which read afresh would say "the graph takes no tensors" (H200, 12-04).
        self.facts = facts
        self.saved_graph: bytes | None = None
        self.saved_lowered: bytes | None = None
        self._run: Any = None  # fast_calls.runnable(lowered), made on the first call
        self.cuda_graphs: CudaGraphsReport | None = None  # set where this graph replays from CUDA graphs

    def __call__(self, inputs: Sequence[Any]) -> Any:
        if self._run is None:
            if self.lowered is None:
                raise RuntimeError(f"{self.graph_name}: loaded graph was never lowered (post_compile not called)")
            self._run = runnable(self.lowered, returns_gradients=self.kind == "backward")
            if self.cuda_graphs is not None:
                self._run = CudaGraphRunner(self._run, self.graph_name, shared_capture(self.cuda_graphs),
                                            self.cuda_graphs)  # fmt: skip
        return self._run(*inputs)

    def use_cuda_graphs(self, record: CompileRecord) -> None:
        """Replay from CUDA graphs if the run (``record.cuda_graphs``) and this graph allow it."""
        if wants_cuda_graphs(self.graph_name, self.facts, record.cuda_graphs):
            self.cuda_graphs = record.cuda_graphs

    def prepare_for_serialization(self) -> None:
        try:
            self.saved_lowered = pack_graph(self.lowered)
        except (TypeError, pickle.PicklingError, AttributeError):  # a region its executor cannot pickle
            from accelrun.compile.passes.cpu_gemm import restore_aten_products
            from accelrun.torch_private import GraphPickler
            from accelrun.torch_private import GraphPicklerOptions as Options

            # fx's pickler saves ops by name: cpu_gemm's product sites are saved as ATen's products
            # carrying the site, and are sites again once loaded (post_compile).
            restore_aten_products(self.graph_module)
            # ops_filter=None: accelrun's graphs hold ATen, functional-collective and accelrun:: ops
            # (the module registering those is imported above, before any graph is loaded).
            self.saved_graph = GraphPickler.dumps(self.graph_module, Options(ops_filter=None))
        self.graph_module = self.lowered = self._run = self.cuda_graphs = None  # this process's, not saved

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        if self.lowered is not None:
            return
        record = _loading_record.get() or CompileRecord()
        if self.saved_lowered is not None:
            # Raises if a kernel library has left the cache: the graph cache then compiles afresh.
            self.lowered = unpack_graph(self.saved_lowered)
            self.notes.add_to(record, regions_lowered_again=False)
            self.use_cuda_graphs(record)
            return
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        from accelrun.compile.lower import lower_regions, make_executors
        from accelrun.compile.passes.cpu_gemm import reinstate_sites
        from accelrun.torch_private import FakeTensorMode, GraphPickler

        gm = GraphPickler.loads(self.saved_graph, FakeTensorMode(shape_env=ShapeEnv()))
        reinstate_sites(gm)
        gm.recompile()
        self.lowered, _ = lower_regions(gm, self.graph_name, self.kind, make_executors(self.executors), record,
                                        self.cache_dir, wait_for_builds=True)  # fmt: skip
        self.notes.add_to(record, regions_lowered_again=True)
        self.graph_module = gm
        self.use_cuda_graphs(record)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass  # accelrun's Triton kernels live in its own cache


@dataclass(frozen=True)
class _NodeRef:
    name: str


def _target_name(target: Any) -> str | GemmSite:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return f"op:{target._schema.name.replace('::', '.')}.{target._overloadname}"
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, GemmSite):  # pickled as itself: its layout and fixed library
        return target
    # Size arithmetic and the runtime assertions on data-dependent sizes (``u0 >= 0``) that AOTAutograd
    # leaves in a graph with unbacked symbols (an MoE's tokens per expert): operator's functions and
    # torch.sym_* by name.
    name = getattr(target, "__name__", None)
    if name and getattr(operator, name, None) is target:
        return f"operator:{name}"
    if name and name.startswith("sym_") and getattr(torch, name, None) is target:
        return f"torch:{name}"
    raise TypeError(f"cannot save a call of {target!r}")


def _resolve_target(name: Any) -> Any:
    if not isinstance(name, str):  # a callable saved as itself (a GemmSite)
        return name
    if name == "getitem":
        return operator.getitem
    if name.startswith("operator:"):
        return getattr(operator, name.split(":", 1)[1])
    if name.startswith("torch:"):
        return getattr(torch, name.split(":", 1)[1])
    if name.startswith("op:"):
        namespace, op, overload = name[3:].rsplit(".", 2)
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    return name


def pack_graph(gm: fx.GraphModule) -> bytes:
    """The lowered graph as picklable records: (op, name, target, args, kwargs, (region id, callable))."""
    from accelrun.compile.extract import FUSED_REGION_KEY

    records, constants = [], {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # a constant AOTAutograd lifted (transformers' Llama: empty tensors)
            if node.users:
                constants[node.target] = _constant(gm, node.target)
                records.append((node.op, node.name, node.target, (), {}, None))
            continue
        if node.op not in ("placeholder", "call_function", "output"):
            raise TypeError(f"cannot save a {node.op} node")
        args = fx.node.map_arg(node.args, lambda n: _NodeRef(n.name))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: _NodeRef(n.name))
        if FUSED_REGION_KEY in node.meta:  # a compiled region: pickled by its executor (CppRegion.__reduce__)
            region = (node.meta[FUSED_REGION_KEY], node.target.compiled)
            records.append((node.op, node.name, None, args, kwargs, region))
        else:
            records.append((node.op, node.name, _target_name(node.target), args, kwargs, None))
    # Nodes are saved without their fake tensors; whether the layouts were fixed goes with them.
    return pickle.dumps({"nodes": records, "constants": constants, STATIC_LAYOUTS: layouts_are_static(gm)})


def _constant(gm: fx.GraphModule, target: str) -> torch.Tensor:
    value = operator.attrgetter(target)(gm)  # a dotted path below the module, as get_attr's target is
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot save a get_attr node of a {type(value).__name__}")
    return value


def unpack_graph(data: bytes) -> fx.GraphModule:
    from accelrun.compile.extract import named_call

    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def ref(a: Any) -> Any:
        if isinstance(a, _NodeRef):
            return env[a.name]
        if isinstance(a, (list, tuple)):
            return type(a)(ref(x) for x in a)
        if isinstance(a, dict):
            return {k: ref(v) for k, v in a.items()}
        return a

    saved = pickle.loads(data)
    for op, name, target, args, kwargs, region in saved["nodes"]:
        if op == "get_attr":
            env[name] = graph.get_attr(target)
            env[name].name = name
            continue
        if region is not None:
            fn = named_call(region[1], region[0])
        else:  # a placeholder's target is its name, whatever it is ("getitem": a value saved for the backward)
            fn = _resolve_target(target) if op == "call_function" else target
        env[name] = graph.create_node(op, fn, ref(args), ref(kwargs), name=name)
    # What runs is fast_calls' copy: this one's code is written only if something reads it (a dump).
    gm = LazyGraphModule(saved["constants"], graph)
    gm.meta[STATIC_LAYOUTS] = saved[STATIC_LAYOUTS]
    return gm


class PrecompiledGraph(BundledAOTAutogradSerializableCallable):
    """What the backend hands torch's precompile path: AOTAutograd's forward, saved and loaded as torch
    saves an Inductor graph (the bundled AOTAutograd entry, holding AccelrunOutputCode's).

    torch 2.13 wraps any compiled function with a ``serialize`` method in the base class itself; torch
    2.11 wraps only Inductor's and refuses everything else ("does not implement SerializableCallable"),
    which left the graph cache empty on the GPU image. So the backend wraps, and this class hides
    ``serialize`` so that 2.13 does not wrap a second time.
    """

    def __getattr__(self, attr: str) -> Any:
        if attr in ("serialize", "compiled_fn"):  # (compiled_fn: not set yet, while unpickling)
            raise AttributeError(attr)
        return getattr(self.compiled_fn, attr)

"""The lowered graph as it runs: ATen calls without the Python layers a readable graph keeps.

A lowered graph calls ops as ``torch.ops.aten.view.default(x, ...)``: readable in dumps and
picklable by name for the graph cache, but each call passes through ``OpOverload.__call__``, a
Python frame in front of the C++ binding. A step of a small Llama makes a few hundred such calls,
most of them views around the matmuls and the compiled regions. So the graph that runs is a copy:

1. Views and ``mm`` are called as Tensor methods (a view costs 9 µs through the OpOverload and 3 µs
   as the method on this CPU); ``view`` as ``reshape`` (``AS_METHODS`` says why).
2. Once the graph has run twice with the same layouts, each chain of views between two computing
   ops (``view`` → ``permute`` → ``slice``, a ``split``'s pieces) becomes one call of Dynamo's
   ``_reinterpret_tensor`` on the chain's base with the sizes, strides and storage offset those runs
   produced. In a step, a view right after a matmul or a region costs 10-30 µs (the matmul has pushed
   the interpreter out of the caches) and a chain pays that for every link; Inductor's generated code
   makes the same C++ call for its views.

Step 2 holds only where layouts are fixed by the graph: every tensor's sizes and strides are
integers (no symbolic or data-dependent sizes; ``layouts_are_static``) and Dynamo's guards pin the
inputs' layouts, so the same ops make the same views on every call. A view keeps its op where the
two recorded calls saw it differently, where it does not share its base's storage, where an op
mutates it, and where a forward or inference graph returns it (or a view of it) as a view of an
input or of another returned tensor: autograd ties a view's version counter and ``_base`` to what
it views, and a reinterpretation has neither (``_collapsible`` says which returned views are
safe). The graph kept for dumps and the graph cache is unchanged.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from accelrun.compile.op_kinds import VIEW_OPS
from accelrun.torch_private import LazyGraphModule
from accelrun.torch_private import reinterpret_tensor as _reinterpret

aten = torch.ops.aten

# The same ATen op as a Tensor method with the same positional arguments. ``view`` runs as ``reshape``,
# which is the same view wherever one exists: the graph's views were traced on fake tensors, and where
# an op's real output is laid out unlike its fake one (CPU batch norm of a transposed input comes back
# contiguous, its meta function says strided like the input) a view could fail where eager had reshaped
# nothing ("view size is not compatible with input tensor's size and stride"). reshape then copies.
AS_METHODS = {
    aten.view.default: torch.Tensor.reshape,
    aten.permute.default: torch.Tensor.permute,
    aten.t.default: torch.Tensor.t,
    aten.unsqueeze.default: torch.Tensor.unsqueeze,
    aten.squeeze.dims: torch.Tensor.squeeze,
    aten.squeeze.dim: torch.Tensor.squeeze,
    aten.expand.default: torch.Tensor.expand,
    aten.select.int: torch.Tensor.select,
    aten.mm.default: torch.Tensor.mm,
}

# Ops whose output shares its input's storage: always, or (``reshape``) when the layouts allow it,
# which the recorded calls check (a view is collapsed only if it shared its base's storage). The
# region partitioner's views plus a few it never meets, and the Tensor methods they run as. Not
# ``as_strided``: its storage offset counts from the storage's start, not from its input's offset,
# which Dynamo does not guard, so it is a base here.
VIEWS = VIEW_OPS | {aten.narrow.default, aten.diagonal.default, aten.unfold.default} | {
    m for op, m in AS_METHODS.items() if op is not aten.mm.default}
# Ops returning a list of views of their input, read with getitem.
SPLITS = frozenset({aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int, aten.chunk.default})

# Ops that make a tensor from numbers alone (a mask's fill value, positions, a gradient's zeros).
CONSTANTS = frozenset({
    aten.scalar_tensor.default, aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default,
    aten.zeros.default, aten.ones.default,
})  # fmt: skip

STATIC_LAYOUTS = "static_layouts"  # gm.meta key: saved with a cached graph, whose nodes keep no meta
RECORDED_CALLS = 2  # calls whose views must agree before chains are collapsed


def layouts_are_static(gm: fx.GraphModule) -> bool:
    """True when every value of ``gm`` has integer sizes and strides (no symbolic or data-dependent
    ones), so the layouts of its views are the same on every call. Unknown (no ``meta["val"]``): False."""
    if STATIC_LAYOUTS in gm.meta:
        return bool(gm.meta[STATIC_LAYOUTS])
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if "val" not in node.meta:
            return False
        vals = node.meta["val"] if isinstance(node.meta["val"], (list, tuple)) else [node.meta["val"]]
        for v in vals:
            if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return False
            if isinstance(v, torch.Tensor) and not all(
                    isinstance(s, int) for s in (*v.shape, *v.stride(), v.storage_offset())):
                return False
    return True


def _with_methods(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in AS_METHODS and not node.kwargs:
            node.target = AS_METHODS[node.target]
    # Its code is written when it first runs: after the recorded calls have rewritten it, once.
    return LazyGraphModule(gm, graph)


def _generated_forward(gm: fx.GraphModule) -> Any:
    """``gm``'s generated forward, written now if it is pending: a lazy module's own forward would pass
    through ``nn.Module.__call__`` on every call."""
    LazyGraphModule.force_recompile(gm)
    return gm.forward


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and src.target in SPLITS
    return node.target in VIEWS


def _view_source(node: fx.Node) -> fx.Node:
    """The tensor a view node views: the input of the op (of the split, for a getitem)."""
    src = node.args[0]
    return src.args[0] if node.target is operator.getitem else src  # type: ignore[union-attr,return-value]


def _collapsible(gm: fx.GraphModule, returns_gradients: bool = False) -> dict[fx.Node, fx.Node]:
    """View node -> the base its chain starts from (the first producer that is not a view), for the
    views that may become one reinterpretation of that base."""
    bases: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if _is_view(node) and isinstance(_view_source(node), fx.Node):
            src = _view_source(node)
            bases[node] = bases.get(src, src)
    # A view the graph returns, directly or through further views, of an input or of a tensor the
    # graph also returns stays a view: autograd ties a view's version counter and ``_base`` to what
    # it views (a saved view of a parameter must notice the optimizer changing it; a returned view of
    # another output must share its versions), and a reinterpretation has neither. A view of an
    # intermediate that is not returned can only be a tensor saved for the backward (AOTAutograd
    # returns the base of any output that aliases an intermediate), which no one else can change.
    # A backward graph returns gradients, which autograd only adds up.
    (output,) = gm.graph.find_nodes(op="output")
    returned_values = set(output.all_input_nodes)
    returned: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node in bases and any(u.op == "output" or u in returned for u in node.users):
            returned.add(node)
    out: dict[fx.Node, fx.Node] = {}
    for node, base in bases.items():
        if node in returned and not returns_gradients and (base.op == "placeholder" or base in returned_values):
            continue
        if any(u.op == "call_function" and isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable
               for u in node.users):
            continue  # a mutation through a view keeps the view an op
        out[node] = base
    return out


class _Recorder(fx.Interpreter):
    """Runs the graph and notes what each collapsible view was: (sizes, strides, offset from its base),
    or None where it did not share its base's storage."""

    def __init__(self, gm: fx.GraphModule, views: dict[fx.Node, fx.Node]) -> None:
        super().__init__(gm)
        self.views, self.bases = views, set(views.values())
        self.storage: dict[fx.Node, tuple[int, int, torch.device]] = {}  # base -> (storage, offset, device)
        self.seen: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n in self.bases and isinstance(out, torch.Tensor):
            # Kept as numbers: the interpreter frees the base's value after its last reader.
            self.storage[n] = (out.untyped_storage().data_ptr(), out.storage_offset(), out.device)
        base = self.views.get(n)
        if base is not None:
            ptr, offset, device = self.storage.get(base, (None, 0, None))
            ok = (type(out) is torch.Tensor and out.device == device
                  and out.untyped_storage().data_ptr() == ptr)  # fmt: skip
            self.seen[n.name] = (tuple(out.shape), out.stride(), out.storage_offset() - offset) if ok else None
        return out


class RunnableGraph:
    """Calls the lowered graph with its inputs as arguments; see the module's docstring."""

    def __init__(self, gm: fx.GraphModule, returns_gradients: bool = False) -> None:
        self.module = _with_methods(gm)
        static = _reinterpret is not None and layouts_are_static(gm)
        self._views = _collapsible(self.module, returns_gradients) if static else {}
        self._records: list[dict[str, Any]] = []
        self.collapsed = 0  # reinterpretations that replaced view chains
        self.hoisted = 0  # constant tensors made once instead of on every call
        # Constants are hoisted after the recorded calls too: by then a region's executor is settled.
        has_constants = any(n.op == "call_function" and n.target in CONSTANTS for n in self.module.graph.nodes)
        self._run = self._record if self._views or has_constants else _generated_forward(self.module)

    @property
    def code(self) -> str:
        return self.module.code

    def __call__(self, *args: Any) -> Any:
        return self._run(*args)

    def _record(self, *args: Any) -> Any:
        if not all(isinstance(a, torch.Tensor) and type(a) in (torch.Tensor, torch.nn.Parameter) for a in args):
            self._run = _generated_forward(self.module)  # a size or a tensor subclass: views stay ops
            return self._run(*args)
        rec = _Recorder(self.module, self._views)
        out = rec.run(*args)
        self._records.append(rec.seen)
        if len(self._records) == RECORDED_CALLS:
            self._collapse()
            self._hoist_constants()
            self._run = _generated_forward(self.module)
        return out

    def _collapse(self) -> None:
        first, *rest = self._records
        graph = self.module.graph
        for node, base in self._views.items():
            layout = first.get(node.name)
            if layout is None or any(r.get(node.name) != layout for r in rest):
                continue
            size, stride, offset = layout
            with graph.inserting_before(node):
                new = graph.call_function(_reinterpret, (base, list(size), list(stride), offset))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
        # The links of collapsed chains (and splits whose pieces all were) are no longer read.
        for node in reversed(list(graph.nodes)):
            if not node.users and (_is_view(node) or node.target is _reinterpret
                                   or (node.op == "call_function" and node.target in SPLITS)):  # fmt: skip
                graph.erase_node(node)
        self.collapsed = len(graph.find_nodes(op="call_function", target=_reinterpret))
        self.module.recompile()
        self._records.clear()

    def _hoist_constants(self) -> None:
        """Tensors made from numbers alone, read only by ops that neither alias nor mutate them, are
        made once and kept on the module. Each costs 10-50 µs a call in a step (an allocation and a
        fill right after a matmul); Inductor writes such constants into its kernels."""
        graph = self.module.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in CONSTANTS or not node.users:
                continue
            inputs: list[fx.Node] = []
            fx.node.map_arg((node.args, node.kwargs), inputs.append)
            if inputs or not all(_only_reads(u) for u in node.users):
                continue
            name = f"_accelrun_constant_{self.hoisted}"
            self.module.register_buffer(name, node.target(*node.args, **node.kwargs), persistent=False)
            with graph.inserting_before(node):
                attr = graph.get_attr(name)
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
            self.hoisted += 1
        if self.hoisted:
            self.module.recompile()


def _only_reads(user: fx.Node) -> bool:
    """True when ``user`` reads its inputs without returning or changing them: an ATen op with no
    mutable argument and no aliasing output, a region compiled by a code generator (fresh outputs),
    or a collapsed view whose users are such."""
    if user.op != "call_function":
        return False
    target = user.target
    if target is _reinterpret:  # a collapsed view: it reads what its own users read
        return all(_only_reads(u) for u in user.users)
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
    if getattr(target, "reads_only", False):  # a call that says so (gemm_choice.GemmSite)
        return True
    compiled = getattr(target, "compiled", None)  # extract.named_call: a region
    return bool(getattr(compiled, "fresh_outputs", False))


def runnable(gm: fx.GraphModule, returns_gradients: bool = False) -> RunnableGraph:
    """What runs ``gm``: its views and matmuls skip ``OpOverload.__call__``, and after two calls its view
    chains are single reinterpretations (same ops, same results). ``returns_gradients``: ``gm`` is an
    AOTAutograd backward, whose returned views may be collapsed too."""
    return RunnableGraph(gm, returns_gradients)

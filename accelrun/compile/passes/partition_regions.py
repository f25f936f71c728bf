"""Group pointwise ops, reductions and the views between them into fusion regions.

Each member gets ``node.meta[REGION_KEY] = region id``; ``extract.extract_regions`` cuts them out.
Policy (what may share a region) is ``_member_shape`` and ``_compatible``; mechanism (grow regions
without making a cycle) is ``_Partitioner``.

The rules:

- Members are pure ``call_function`` nodes of kind pointwise, reduction, view or constant
  (``op_kinds.node_kind``) whose ``meta["val"]`` is one strided tensor and that the code generators
  can lower (``codegen.values.lowers``: the same rule table they build kernels from). Placeholders, get_attr,
  the output and kind "other" (matmuls, attention, random ops, collectives) never join. A
  softmax is a reduction over its rows whose output is as large as its input; a constant read by
  several users is copied for each first, so each region holds it as a number.
- Growth: nodes are visited in graph order; a node joins the region of each of its producers, in
  argument order, when the merge is legal; otherwise it starts its own.
- No cycles: merging A and B is refused if a path leads from one to the other through anything
  outside both. Regions are contracted as they grow, so the check walks the graph of regions: a path
  may enter a region at one node and leave it at another. Hence the graph whose vertices are the
  regions and the unmarked nodes stays acyclic, and each region can run as one call.
- One iteration space per region. All reductions of a region read tensors of the same shape; each
  folds its leading axes (a column sum: a norm's weight gradient) or its trailing ones (a row sum),
  and reductions over different axes may share a region (a norm's backward: the weight gradient and
  the row sums of the input gradient). Every member's numel (a pointwise output; a view's input and
  output) is then the reductions' input numel ("full") or one of their output numels ("reduced").
  A region without reductions has a single numel, unless it holds a gather (a cat, a slice or
  select, an expand of at most 8x, a sum over a few middle axes that code generators unroll): then
  numels may differ, every member being computed at the indices its users read, one loop per
  output shape (RoPE's halves and their cat; GQA's head sums). So a region is one elementwise loop, or loops
  over rows doing prologue, reductions and epilogue (softmax, RMSNorm), plus at most one loop
  accumulating columns; each loop recomputes the pointwise values it needs from the region's
  inputs rather than reading them from memory another loop wrote.
- Views stay where they connect members, and where they view an outside tensor for members only
  (the region then reads the base at the view's indices; an ATen view call costs 5-30 µs in a step,
  right after a matmul). A view whose users are all outside, or that is read both inside and outside,
  is left out (the region writes or reads what the view is of).
- Size: at most ``max_nodes`` nodes; a region with fewer than ``min_ops`` compute ops (pointwise or
  reduction) is left unmarked.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from accelrun.compile.codegen.loop_ir import writes_as_laid_out
from accelrun.compile.codegen.values import MAX_UNROLLED_REDUCTION, is_short_middle_reduction, lowers
from accelrun.compile.op_kinds import ROW_SOFTMAX, node_kind
from accelrun.compile.passes.base import PassContext, PassResult, register_pass
from accelrun.compile.passes.dce import op_is_pure
from accelrun.compile.regions import REGION_KEY
from accelrun.config.compile_names import PartitionRegionsOptions


@dataclass(frozen=True)
class _Reduction:
    """One reduction of a region: the shape it reads and the axes it folds."""

    in_shape: tuple[Any, ...]
    dims: tuple[int, ...]
    full: Any  # numel read
    reduced: Any  # numel written


@dataclass(eq=False)  # identity: groups are keys and are compared with `is`
class _Group:
    nodes: list[fx.Node]
    numels: set[Any]
    reductions: frozenset[_Reduction]  # at most one per set of folded axes, all over one input shape
    device: torch.device
    removed: bool = False  # merged into another group
    gathers: bool = False  # holds a cat: its parts' numels may differ from the output's


def _size(x: Any) -> Any:
    # Sizes are ints for static shapes; a symbolic size is compared by its expression.
    return x if isinstance(x, int) else str(x)


def _numel(val: torch.Tensor) -> Any:
    sizes = [_size(s) for s in val.shape]
    return math.prod(sizes) if all(isinstance(s, int) for s in sizes) else str(val.numel())


def _tensor_val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.layout == torch.strided:
        return val
    return None


# Bytes kept alive longer by a merge that are worth two regions instead of one: below, the pass over
# memory a merge saves is worth more (a loss's scalar sums keep a few hundred bytes longer).
LONGER_LIVES_WORTH_A_SPLIT = 1 << 20


def _bytes(node: fx.Node) -> int:
    """The bytes of a node's tensor; 0 where its size is symbolic or it is no strided tensor."""
    val = _tensor_val(node)
    if val is None or not all(isinstance(x, int) for x in val.shape):
        return 0
    return val.numel() * val.element_size()


def _writable(val: torch.Tensor | None) -> bool:
    """Whether a kernel can write ``val`` as it is laid out; unknown and symbolic layouts count as yes."""
    if val is None or not all(isinstance(x, int) for x in (*val.shape, *val.stride())):
        return True
    return writes_as_laid_out(val)


def _reduced_dims(node: fx.Node, ndim: int) -> tuple[int, ...] | None:
    """The axes a reduction folds, from its schema's ``dim`` argument; None if it cannot be read."""
    target = node.target
    names = [a.name for a in target._schema.arguments]
    if "dim" not in names:
        return tuple(range(ndim))  # e.g. sum.default: everything
    i = names.index("dim")
    dim = node.args[i] if i < len(node.args) else node.kwargs.get("dim")
    if dim is None or dim == []:
        return tuple(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not all(isinstance(d, int) for d in dims):
        return None
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dims}))


@dataclass(frozen=True)
class _Member:
    """How a node may join a region: the numels it touches, its reduction, and whether it gathers
    (each output element from a few input elements at other indices, so numels may differ)."""

    numels: set[Any]
    reduction: _Reduction | None = None
    gathers: bool = False


def _member_shape(node: fx.Node) -> _Member | None:
    """How ``node`` may join a region, or None if it may not."""
    kind = node_kind(node)
    if not lowers(node):  # the code generators' own rule table: regions are what they can build
        return None
    if node.target is torch.ops.aten.cat.default:
        return _cat_shape(node)
    if kind == "other" or not op_is_pure(node.target):
        return None
    out = _tensor_val(node)
    if out is None:
        return None
    if kind in ("pointwise", "constant"):
        return _Member({_numel(out)})
    src = _tensor_val(node.args[0]) if node.args else None
    if src is None:
        return None
    if kind == "view":
        return _Member({_numel(src), _numel(out)}, gathers=_gathers(src, out))
    dims = _reduced_dims(node, src.dim())
    if dims is None:
        return None
    reduced = _numel(out)
    if node.target in ROW_SOFTMAX:  # reduces its rows, then writes a whole-size output
        row = _size(src.shape[dims[0]]) if len(dims) == 1 else None
        if not isinstance(row, int) or not isinstance(reduced, int):
            return None
        reduced //= row
    red = _Reduction(tuple(_size(s) for s in src.shape), dims, _numel(src), reduced)
    if is_short_middle_reduction(red.in_shape, red.dims):
        return _Member({red.full, red.reduced}, gathers=True)
    return _Member({red.full, red.reduced}, red)


def _gathers(src: torch.Tensor, out: torch.Tensor) -> bool:
    """A view that changes the numel: a slice or select (fewer elements), or an expand that repeats
    each element at most ``MAX_UNROLLED_REDUCTION`` times (GQA's key/value heads for the query
    heads), so that what feeds it is recomputed only that often."""
    n_src, n_out = _numel(src), _numel(out)
    if not (isinstance(n_src, int) and isinstance(n_out, int)) or n_src == n_out:
        return False
    return n_out < n_src or n_out <= n_src * MAX_UNROLLED_REDUCTION


def _cat_shape(node: fx.Node) -> _Member | None:
    """A cat joins regions without reductions: each output element is one element of one part, so
    the parts' producers (RoPE's rotated halves) are computed where the cat writes."""
    out = _tensor_val(node)
    parts = node.args[0] if node.args and isinstance(node.args[0], (list, tuple)) else []
    vals = [_tensor_val(p) for p in parts]
    if out is None or not vals or any(v is None or v.dim() != out.dim() for v in vals):
        return None
    return _Member({_numel(out), *(_numel(v) for v in vals)}, gathers=True)


def _folds_an_end(red: _Reduction) -> bool:
    """Leading or trailing axes: what the loop IR can reduce (a row sum or a column sum)."""
    n, k = len(red.in_shape), len(red.dims)
    return red.dims in (tuple(range(k)), tuple(range(n - k, n)))


def _compatible(a: _Group, b: _Group) -> bool:
    if a.device != b.device:
        return False
    reds = a.reductions | b.reductions
    if not reds:
        # With a gather every member is computed at the indices its users read (a loop per output
        # shape), so numels may differ; without one, one elementwise loop of one numel.
        return a.gathers or b.gathers or (len(a.numels) == 1 and a.numels == b.numels)
    if a.gathers or b.gathers:
        return False
    if len(reds) > 1:  # mixed: one input shape (so one per set of axes), each over an end
        if len({r.in_shape for r in reds}) > 1 or not all(_folds_an_end(r) for r in reds):
            return False
    allowed = {next(iter(reds)).full} | {r.reduced for r in reds}
    return (a.numels | b.numels) <= allowed


class _Partitioner:
    def __init__(self, graph: fx.Graph, max_nodes: int) -> None:
        self.graph = graph
        self.max_nodes = max_nodes
        self.index = {n: i for i, n in enumerate(graph.nodes)}
        self.group_of: dict[fx.Node, _Group] = {}
        self.groups: list[_Group] = []

    def grow(self) -> None:
        for node in self.graph.nodes:
            member = _member_shape(node)
            if member is None:
                continue
            group = self._new_group(node, member)
            producers = list(dict.fromkeys(self.group_of[p] for p in node.all_input_nodes if p in self.group_of))
            for producer in producers:
                if producer is not group and self._can_merge(producer, group, self.index[node]):
                    group = self._merge(producer, group)

    def _new_group(self, node: fx.Node, member: _Member) -> _Group:
        reductions = frozenset([member.reduction]) if member.reduction is not None else frozenset()
        group = _Group([node], set(member.numels), reductions, _tensor_val(node).device, gathers=member.gathers)
        self.group_of[node] = group
        self.groups.append(group)
        return group

    def _can_merge(self, a: _Group, b: _Group, horizon: int) -> bool:
        if len(a.nodes) + len(b.nodes) > self.max_nodes or not _compatible(a, b):
            return False
        if self._path_outside(a, b, horizon) or self._path_outside(b, a, horizon):
            return False
        return not self._lengthens_lives(a, b, horizon)

    def _lengthens_lives(self, a: _Group, b: _Group, horizon: int) -> bool:
        """Whether running ``a``'s ops later, in one region with ``b``, keeps more bytes alive than
        running them where they are: the merged region waits for what ``b`` reads that is computed after
        ``a`` (a region runs once its inputs are ready), and the tensors that die in ``a`` would live on
        until then, where only ``a``'s results read by ``b`` would have. Refused where that adds 1 MiB
        or more and more than those results themselves: a running sum fed by a product per step (the
        chunked head and loss's weight gradient under autocast, a bf16 part per chunk summed in fp32)
        grew into one region at the end that held every chunk's part at once; a three-way sum of input
        gradients (two dying, one kept) stays one region."""
        computed = [self.index[n] for n in a.nodes if node_kind(n) in ("pointwise", "reduction")]
        if not computed or not any(node_kind(n) in ("pointwise", "reduction") for n in b.nodes):
            return False  # views join where they are: what runs later is decided by the ops they connect
        members = set(a.nodes) | set(b.nodes)
        last = max(computed)
        if not any(p not in members and self.index.get(p, -1) > last for n in b.nodes for p in n.all_input_nodes):
            return False  # b waits for nothing computed after a: the merged region runs where a would
        inputs = {p for n in a.nodes for p in n.all_input_nodes if p not in members}
        dying = sum(_bytes(p) for p in inputs
                    if p.op not in ("placeholder", "get_attr") and all(u in a.nodes for u in p.users))
        # a's results that b alone reads: these would have waited instead, and now need not
        folded = sum(_bytes(n) for n in a.nodes
                     if all(u in members for u in n.users) and any(u in b.nodes for u in n.users))
        return dying - folded >= max(LONGER_LIVES_WORTH_A_SPLIT, folded)

    def _path_outside(self, src: _Group, dst: _Group, horizon: int) -> bool:
        """Is there a path src -> ... -> dst through at least one node outside both?

        Walks regions as wholes (entering a region at one node lets the path leave from any of its
        nodes). Nodes after ``horizon`` (the node being placed) are skipped: they belong to no
        region yet, and edges only lead forward from them, so they cannot lead back into dst.
        """
        seen: set[fx.Node] = set()
        seen_groups = {src}
        queue: deque[fx.Node] = deque()

        def visit(users: Iterable[fx.Node]) -> None:
            for user in users:
                if user not in seen and self.index[user] <= horizon:
                    seen.add(user)
                    queue.append(user)

        # Edges straight from src into dst are what a merge is for; only detours count.
        visit(u for n in src.nodes for u in n.users if self.group_of.get(u) not in (src, dst))
        while queue:
            node = queue.popleft()
            group = self.group_of.get(node)
            if group is dst:
                return True
            if group is None:
                visit(node.users)
            elif group not in seen_groups:
                seen_groups.add(group)
                visit(u for n in group.nodes for u in n.users)
        return False

    def _merge(self, a: _Group, b: _Group) -> _Group:
        a.nodes.extend(b.nodes)
        a.numels |= b.numels
        a.reductions = a.reductions | b.reductions
        a.gathers = a.gathers or b.gathers
        for n in b.nodes:
            self.group_of[n] = a
        b.removed = True
        return a

    def drop_boundary_views(self) -> None:
        """Leave out views that do not sit between two members (repeat: leaving one out may expose
        another). Taking such a view out cannot create a cycle: it has no producer or no user left
        inside, so no path can leave the region through it and come back."""
        changed = True
        while changed:
            changed = False
            for group in self.live_groups():
                for v in list(group.nodes):
                    if node_kind(v) != "view":
                        continue
                    inside_input = self.group_of.get(v.args[0]) is group
                    inside_users = [self.group_of.get(u) is group for u in v.users]
                    # Kept: a view between members, and a view of an outside tensor read only inside
                    # (the region then reads the base at the view's indices: no ATen view call).
                    if not (any(inside_users) and (inside_input or all(inside_users))):
                        group.nodes.remove(v)
                        del self.group_of[v]
                        changed = True

    def copy_out_scattered_views(self) -> None:
        """Give a view's readers outside its region a copy of the view, where the view is kept (its
        input and some readers are inside) but its value is not dense (an expand's zero strides): as a
        region output no kernel can write it, and the executor declined the whole region (transformers'
        Llama without its KV cache: the position ids' expand beside RoPE ran unfused in ATen). The copy
        is of the view's whole chain of views inside the region, so it views what the region writes (a
        dense tensor) or the outside tensor the chain starts from, and no view of an outside tensor is
        left read both inside and outside.

        A dense view gets the same where what its chain views is itself an output of the region (a
        linear's input gradient, returned flat for the weight's product and viewed for the residual
        and the bias's sum) and its readers outside neither return it nor view it further
        (``_viewed_outside``): the region writes the tensor once and those readers view it, as
        eager's do, instead of the region writing its elements a second time."""
        for group in self.live_groups():
            for view in list(group.nodes):
                if node_kind(view) != "view" or self.group_of.get(view.args[0]) is not group:
                    continue
                outside = [u for u in view.users if self.group_of.get(u) is not group]
                if not outside or len(outside) == len(view.users):
                    continue
                chain = [view]
                while node_kind(chain[0].args[0]) == "view" and self.group_of.get(chain[0].args[0]) is group:
                    chain.insert(0, chain[0].args[0])
                if _writable(_tensor_val(view)) and not self._viewed_outside(view, outside, chain[0].args[0], group):
                    continue
                copy, last = chain[0].args[0], view
                for link in chain:
                    with self.graph.inserting_after(last):
                        copy = self.graph.node_copy(link, lambda n, src=link.args[0], new=copy: new if n is src else n)
                    self.index[copy], last = self.index[view], copy
                for user in outside:
                    user.replace_input_with(view, copy)

    def _viewed_outside(self, view: fx.Node, outside: list[fx.Node], base: fx.Node, group: _Group) -> bool:
        """Whether the readers outside of a dense ``view`` may view ``base`` outside the region instead:
        the region writes ``base`` out anyway (a member read outside), and no such reader returns the
        view or views it further. A returned view of another returned tensor shares its storage: two
        parameters' gradients would then be one buffer, and accumulating into one changes the other."""
        if self.group_of.get(base) is not group or all(self.group_of.get(u) is group for u in base.users):
            return False
        return not any(u.op == "output" or node_kind(u) == "view" for u in outside)

    def live_groups(self) -> list[_Group]:
        return [g for g in self.groups if not g.removed and g.nodes]


def compute_ops(nodes: list[fx.Node]) -> int:
    # A softmax is several ops (a max, a sum, exp and the epilogue): alone it is worth a region.
    return sum(3 if n.target in ROW_SOFTMAX else 1 for n in nodes if node_kind(n) in ("pointwise", "reduction"))


def split_shared_constants(graph: fx.Graph) -> int:
    """Give each user of a constant (``full``, ``scalar_tensor``, ...) a copy of its own, so every
    region that reads it holds it as a number instead of one region writing it out for the others.
    Returns how many copies were made."""
    made = 0
    for node in list(graph.nodes):
        if node_kind(node) != "constant" or len(node.users) < 2:
            continue
        for user in list(node.users)[1:]:
            with graph.inserting_after(node):
                copy = graph.node_copy(node)
            user.replace_input_with(node, copy)
            made += 1
    return made


def partition(graph: fx.Graph, max_nodes: int = 64, min_ops: int = 2, first_id: int = 0) -> dict[int, list[fx.Node]]:
    """Mark regions on ``graph``'s nodes; returns region id -> nodes in graph order."""
    for node in graph.nodes:
        node.meta.pop(REGION_KEY, None)
    split_shared_constants(graph)
    parts = _Partitioner(graph, max_nodes)
    parts.grow()
    parts.drop_boundary_views()
    parts.copy_out_scattered_views()
    kept = [g for g in parts.live_groups() if compute_ops(g.nodes) >= min_ops]
    kept.sort(key=lambda g: min(parts.index[n] for n in g.nodes))  # ids in graph order
    regions: dict[int, list[fx.Node]] = {}
    for rid, group in enumerate(kept, start=first_id):
        nodes = sorted(group.nodes, key=parts.index.__getitem__)
        for n in nodes:
            n.meta[REGION_KEY] = rid
        regions[rid] = nodes
    return regions


@register_pass("partition_regions", "post_grad", PartitionRegionsOptions)
def partition_regions(gm: fx.GraphModule, options: PartitionRegionsOptions, ctx: PassContext) -> PassResult:
    """Group pointwise/reduction chains (and the views between them) into fusion regions."""
    first_id = ctx.notes.next_region_id
    regions = partition(gm.graph, options.max_nodes, options.min_ops, first_id)
    ctx.notes.next_region_id = first_id + len(regions)
    ops = sum(compute_ops(nodes) for nodes in regions.values())
    counts = {
        "regions": len(regions), "ops": ops,
        "nodes": sum(len(nodes) for nodes in regions.values()),
        "largest": max((len(nodes) for nodes in regions.values()), default=0),
    }  # fmt: skip
    # Its nodes with the views between them too: what `compile explain`'s table of regions lists (a trial
    # added up 49 there against "over 28 ops").
    views = f" ({counts['nodes']} with the views between them)" if counts["nodes"] != ops else ""
    return PassResult(changed=bool(regions), summary=f"formed {len(regions)} regions over {ops} ops{views}",
                      counts=counts)

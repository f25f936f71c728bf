"""Rematerialisation: the backward recomputes cheap activations instead of reading them from memory.

Runs at the partition stage on the ``(forward, backward)`` pair that
``torch._functorch.partitioners.default_partition`` produced. Its conventions (torch 2.13):

- forward outputs = the function's real outputs, then the saved values: tensors (those saved without
  a version-counter check last), opaque objects, then SymInts;
- backward placeholders = the saved SymInts, then the saved tensors (same order as in the forward's
  outputs), then ``tangents_*`` (and RNG seeds / backward state); each saved placeholder has the
  name of the forward node it receives.

The number of real outputs is ``ctx.notes.num_fwd_outputs`` when the caller knows it; otherwise it
is inferred from the backward's non-tangent placeholders and checked against the names.

Cost model: an activation costs ``numel * element size`` of its ``meta["val"]``; primal inputs are
free (the caller holds them anyway), but a chain may read only those that stay as the forward saw
them (``unreadable_primals``: parameters and buffers it does not change, inputs it saves anyway). A saved tensor can be dropped when it is the end of a chain of
cheap ops (``recompute`` kinds, pure, at most ``max_chain`` nodes) whose inputs are saved values or
primals; dropping it never increases saved bytes. Greedy: while saved bytes exceed the budget, drop
the candidate that frees the most bytes per recomputed compute op (earliest first on ties). With no
budget, every candidate is dropped. The backward then recomputes each dropped value's chain just
before its first use; the forward stops returning it (and loses nodes nothing else needed).
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from accelrun.compile.op_kinds import node_kind
from accelrun.compile.passes.base import GraphNotes, PassContext, PassResult, register_pass
from accelrun.compile.passes.dce import eliminate_dead_code, op_is_pure
from accelrun.config.compile_names import RematOptions

RECOMPUTED_KEY = "accelrun_recomputed"  # meta on backward nodes copied from the forward
_MiB = 2**20


class LayoutError(ValueError):
    """The pair does not follow the partitioner's conventions this pass relies on."""


@dataclass
class SavedLayout:
    num_real: int  # forward outputs that are the function's own outputs
    saved: list[fx.Node]  # forward nodes saved for the backward, in forward-output order
    bw_saved: list[fx.Node]  # backward placeholders receiving them (SymInts first)
    bw_rest: list[fx.Node]  # the other backward placeholders (tangents, seeds, state)


def _is_sym(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _is_saved_placeholder(node: fx.Node) -> bool:
    name = str(node.target)
    if "tangents" in name or "bwd_seed" in name or "bwd_base_offset" in name:
        return False
    return type(node.meta.get("val")).__name__ != "BackwardState"


def _bw_order(saved: list[fx.Node]) -> list[fx.Node]:
    return [s for s in saved if _is_sym(s)] + [s for s in saved if not _is_sym(s)]


def saved_layout(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int | None = None) -> SavedLayout:
    outs = list(fw.graph.output_node().args[0])
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    bw_saved = [p for p in placeholders if _is_saved_placeholder(p)]
    num_real = len(outs) - len(bw_saved) if num_fwd_outputs is None else num_fwd_outputs
    saved = outs[num_real:]
    if num_real < 0 or len(saved) != len(bw_saved) or not all(isinstance(s, fx.Node) for s in saved):
        raise LayoutError(f"{len(outs)} forward outputs cannot end with {len(bw_saved)} saved values")
    if [s.name for s in _bw_order(saved)] != [p.name for p in bw_saved]:
        raise LayoutError("the backward's saved placeholders do not match the forward's saved outputs")
    return SavedLayout(num_real, saved, bw_saved, [p for p in placeholders if not _is_saved_placeholder(p)])


def tensor_bytes(node: fx.Node) -> int:
    """The bytes of ``node``'s tensor; for a size that is a symbol (a graph for any length), at the size it
    was traced with. ``int()`` of the symbol would have made Dynamo guard on that size: a graph per size
    (found when remat joined the default passes)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    numel = val.numel()
    if isinstance(numel, torch.SymInt):
        numel = numel.node.hint  # an estimate that guards on nothing; None for a data-dependent size
        if numel is None:
            return 0
    return int(numel) * val.element_size()


def _saved_bytes(saved: list[fx.Node]) -> int:
    return sum(tensor_bytes(s) for s in dict.fromkeys(saved) if s.op != "placeholder")


class _Planner:
    def __init__(self, kinds: set[str], max_chain: int, keep: AbstractSet[fx.Node] = frozenset(),
                 unreadable: AbstractSet[fx.Node] = frozenset()) -> None:  # fmt: skip
        self.kinds = kinds
        self.max_chain = max_chain
        self.keep = keep  # saved values that must stay the forward's own (compared_in_backward)
        self.unreadable = unreadable  # primals a recomputation must not read (unreadable_primals)

    def cheap(self, node: fx.Node) -> bool:
        return (node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
                and op_is_pure(node.target) and node_kind(node) in self.kinds)  # fmt: skip

    def chain(self, value: fx.Node, available: set[fx.Node]) -> list[fx.Node] | None:
        """Forward nodes to recompute ``value`` from ``available`` values and primals, or None."""
        chain: list[fx.Node] = []
        seen: set[fx.Node] = set()
        stack = [value]
        while stack:
            node = stack.pop()
            if node in seen or (node is not value and node in available):
                continue
            if node.op == "placeholder":
                if node in self.unreadable:
                    return None
                continue
            seen.add(node)
            if not self.cheap(node) or len(chain) >= self.max_chain:
                return None
            chain.append(node)
            stack.extend(node.all_input_nodes)
        return chain

    def score(self, value: fx.Node, available: set[fx.Node]) -> float | None:
        """Bytes freed per node recomputed by dropping ``value`` (views cost nothing), or None where it
        cannot be dropped (a primal, one the backward compares, no cheap chain from ``available``)."""
        gain = tensor_bytes(value) if value.op != "placeholder" and value not in self.keep else 0
        chain = self.chain(value, available) if gain else None
        if chain is None:
            return None
        return gain / max(1, sum(node_kind(n) != "view" for n in chain))

    def plan(self, saved: list[fx.Node], budget: int | None) -> list[fx.Node]:
        """Saved tensors to drop, in the order the greedy picked them: each time the best score, the
        earliest saved among equals.

        Lazily: a value's chain only grows as others are dropped (they are no longer there to start
        from), so its score only falls, and a score computed earlier bounds it. The best by its last
        score is scored again, and taken if it is still the best; else it goes back with its new score.
        Scoring every kept value for every drop took 140 s of a 4-layer model's compile whose forward
        loops over 256 time steps (RWKV written plainly: thousands of saved values)."""
        kept = list(dict.fromkeys(saved))
        available = set(kept)
        total = _saved_bytes(kept)
        heap = [(-score, i, v) for i, v in enumerate(kept) if (score := self.score(v, available)) is not None]
        heapq.heapify(heap)
        dropped: list[fx.Node] = []
        while heap and (budget is None or total > budget):
            _, i, value = heapq.heappop(heap)
            score = self.score(value, available)
            if score is None:
                continue  # no chain any more: it never has one again
            if heap and (-score, i) > heap[0][:2]:
                heapq.heappush(heap, (-score, i, value))  # another may be better now
                continue
            available.discard(value)
            total -= tensor_bytes(value)
            dropped.append(value)
        return dropped


# Comparisons: a backward that compares a saved value (amax's and max's backward: ``x == max``, then a
# division by how many are equal) needs the forward's very bits, and a recomputed value, fused with other
# ops, is rounded at other points (bf16 kept in fp32 inside a kernel): no element equalled the max, and
# the gradient was 0 / 0 (a random program's NaN, found when remat joined the default passes).
_COMPARISONS = frozenset({"eq", "ne", "gt", "ge", "lt", "le"})
_PASSED_THROUGH = frozenset({"convert_element_type", "_to_copy", "clone"})  # the value, in another dtype or copy


def compared_in_backward(placeholder: fx.Node) -> bool:
    """Whether the backward compares the value ``placeholder`` receives, directly or through views,
    casts and copies."""
    stack, seen = [placeholder], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            name = getattr(getattr(user.target, "overloadpacket", None), "__name__", "")
            if name in _COMPARISONS:
                return True
            if node_kind(user) == "view" or name in _PASSED_THROUGH:
                stack.append(user)
    return False


def unreadable_primals(fw: fx.GraphModule, saved: list[fx.Node], notes: GraphNotes) -> set[fx.Node]:
    """The forward's inputs a recomputation in the backward must not read, where eager's backward reads
    what the forward computed from them:

    - those the forward changes in place (a running statistic in a buffer, an input scaled with
      ``mul_``, a buffer written through ``.data``): the backward would read the new value. Autograd then
      stopped the step ("modified by an inplace operation"), or nothing noticed and the gradients were
      wrong. AOTAutograd says which: the forward returns each one's new value, described by
      ``InputMutationAOTOutput`` naming the input's own description;
    - inputs that are neither parameters nor buffers (activations, the caller's tensors) and that the
      forward does not save anyway: saving one instead of what it computed exposes it to the caller's
      in-place changes before the backward, which eager's saved values are not.

    Every input, where AOTAutograd's descriptions or static inputs are not known (``inputs_described``)."""
    from accelrun.torch_private import InputMutationAOTOutput

    primals = list(fw.graph.find_nodes(op="placeholder"))
    if not inputs_described(fw, notes):
        return set(primals)
    outputs = fw.graph.output_node().meta["desc"]
    ids = [p.meta["desc"].idx for p in primals]
    changed = [d.mutated_input for d in outputs if isinstance(d, InputMutationAOTOutput)]
    saved_already = set(saved)
    return {p for p, i in zip(primals, ids, strict=True)
            if p.meta["desc"] in changed or (i not in notes.static_inputs and p not in saved_already)}


def inputs_described(fw: fx.GraphModule, notes: GraphNotes) -> bool:
    """Whether ``unreadable_primals`` can tell the forward's inputs apart: AOTAutograd described its
    outputs and each input, and the partitioner named the static inputs."""
    ids = [getattr(p.meta.get("desc"), "idx", None) for p in fw.graph.find_nodes(op="placeholder")]
    return (notes.static_inputs is not None and isinstance(fw.graph.output_node().meta.get("desc"), list)
            and None not in ids)


def rematerialize(fw: fx.GraphModule, bw: fx.GraphModule, budget_bytes: int | None,
                  kinds: set[str], max_chain: int = 16, num_fwd_outputs: int | None = None,
                  notes: GraphNotes | None = None,
                  ) -> tuple[fx.GraphModule, fx.GraphModule, dict[str, int]]:  # fmt: skip
    """The new (forward, backward) pair and its counts; ``fw`` and ``bw`` are left unchanged. With the
    Dynamo graph's ``notes``, no recomputation reads an input ``unreadable_primals`` names."""
    layout = saved_layout(fw, bw, num_fwd_outputs)
    unreadable = unreadable_primals(fw, layout.saved, notes) if notes is not None else frozenset()
    by_name = {p.name: p for p in layout.bw_saved}
    compared = {s for s in layout.saved if s.name in by_name and compared_in_backward(by_name[s.name])}
    dropped = set(_Planner(kinds, max_chain, keep=compared, unreadable=unreadable).plan(layout.saved, budget_bytes))
    kept = [s for s in layout.saved if s not in dropped]
    needed_primals = _primals_needed(fw, dropped, set(kept))
    # New saved primals go with the version-checked tensors (before no-vc-check tensors and non-tensors).
    at = next((i for i, s in enumerate(kept) if not isinstance(s.meta.get("val"), torch.Tensor)
               or s.meta.get("saved_tensor_with_no_vc_check")), len(kept))  # fmt: skip
    new_saved = kept[:at] + needed_primals + kept[at:]

    new_fw = _rebuild_forward(fw, layout, new_saved)
    new_bw, recomputed = _rebuild_backward(bw, layout, new_saved, dropped)
    counts = {
        "saved_bytes_before": _saved_bytes(layout.saved), "saved_bytes_after": _saved_bytes(new_saved),
        "recomputed_nodes": recomputed, "dropped_saved": len(dropped), "saved_primals_added": len(needed_primals),
        "inputs_undescribed": int(notes is not None and not inputs_described(fw, notes)),
    }  # fmt: skip
    return new_fw, new_bw, counts


def _primals_needed(fw: fx.GraphModule, dropped: set[fx.Node], kept: set[fx.Node]) -> list[fx.Node]:
    """Primal inputs the recomputed chains read that the forward does not already save."""
    needed: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = list(dropped)
    while stack:
        node = stack.pop()
        if node in seen or node in kept:
            continue
        seen.add(node)
        if node.op == "placeholder":
            needed.add(node)
        else:
            stack.extend(node.all_input_nodes)
    return [p for p in fw.graph.find_nodes(op="placeholder") if p in needed]


def _rebuild_forward(fw: fx.GraphModule, layout: SavedLayout, new_saved: list[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    outs, old_output = graph.graph_copy(fw.graph, env, return_output_node=True)
    real = list(outs)[: layout.num_real]
    output = graph.output(tuple(real + [env[s] for s in new_saved]))
    output.meta = _output_meta(old_output, layout, new_saved)
    eliminate_dead_code(graph)  # nodes that only fed dropped saved values
    return fx.GraphModule(fw, graph)


def _output_meta(old_output: fx.Node, layout: SavedLayout, new_saved: list[fx.Node]) -> dict[str, Any]:
    """AOTAutograd describes each forward output (``desc``); renumber the saved ones."""
    meta = {k: v for k, v in old_output.meta.items() if k not in ("desc", "output_stack_traces")}
    old_desc = old_output.meta.get("desc")
    if isinstance(old_desc, list) and len(old_desc) == len(old_output.args[0]):
        from accelrun.torch_private import SavedForBackwardsAOTOutput

        by_node = dict(zip(layout.saved, old_desc[layout.num_real :], strict=True))
        saved_desc = []
        for i, s in enumerate(new_saved):
            d = by_node.get(s)
            saved_desc.append(type(d)(i) if d is not None and hasattr(d, "idx") else SavedForBackwardsAOTOutput(i))
        meta["desc"] = old_desc[: layout.num_real] + saved_desc
    return meta


def _rebuild_backward(bw: fx.GraphModule, layout: SavedLayout, new_saved: list[fx.Node],
                      dropped: set[fx.Node]) -> tuple[fx.GraphModule, int]:  # fmt: skip
    graph = fx.Graph()
    fenv: dict[fx.Node, fx.Node] = {}  # forward node -> its value in the new backward
    env: dict[fx.Node, fx.Node] = {}  # old backward node -> new backward node
    old_ph = {p.name: p for p in layout.bw_saved}
    for s in _bw_order(new_saved):
        old = old_ph.get(s.name)
        ph = graph.placeholder(s.name)
        ph.meta = copy.copy(old.meta if old is not None else s.meta)
        fenv[s] = ph
        if old is not None:
            env[old] = ph
    for p in layout.bw_rest:
        env[p] = graph.placeholder(p.name)
        env[p].meta = copy.copy(p.meta)
    dropped_ph = {old_ph[s.name]: s for s in dropped}
    recomputed = 0

    def materialise(value: fx.Node) -> fx.Node:
        # Iterative post-order copy of the forward chain that computes `value`.
        nonlocal recomputed
        stack = [value]
        while stack:
            node = stack[-1]
            if node in fenv:
                stack.pop()
                continue
            missing = [i for i in node.all_input_nodes if i not in fenv]
            if missing:
                stack.extend(missing)
                continue
            assert node.op == "call_function", f"remat: {node.name} is not recomputable"
            fenv[node] = graph.node_copy(node, fenv.__getitem__)
            fenv[node].meta[RECOMPUTED_KEY] = True
            recomputed += 1
            stack.pop()
        return fenv[value]

    for node in bw.graph.nodes:
        if node.op == "placeholder":
            continue
        for inp in node.all_input_nodes:
            if inp in dropped_ph and inp not in env:
                env[inp] = materialise(dropped_ph[inp])
        env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule(bw, graph), recomputed


@register_pass("remat", "partition", RematOptions)
def remat(gm: Any, options: RematOptions, ctx: PassContext) -> PassResult:
    """Recompute cheap saved activations in the backward while saved bytes exceed a budget."""
    fw, bw = gm
    budget = None if options.budget_mb is None else int(options.budget_mb * _MiB)
    try:
        new_fw, new_bw, counts = rematerialize(fw, bw, budget, set(options.recompute), options.max_chain,
                                               ctx.notes.num_fwd_outputs, ctx.notes)  # fmt: skip
    except LayoutError as e:
        return PassResult(changed=False, summary=f"skipped: {e}")
    before, after = counts["saved_bytes_before"], counts["saved_bytes_after"]
    met = budget is None or after <= budget
    counts["budget_met"] = int(met)
    summary = (f"saved {before / _MiB:.3f} -> {after / _MiB:.3f} MiB, recomputed {counts['recomputed_nodes']} nodes"
               + ("" if met else f" (budget {options.budget_mb} MiB not reached)")
               # a torch whose AOTAutograd does not describe them: safe, but what is saved anyway is kept
               + ("; no input read again: AOTAutograd did not say which the forward changes"
                  if counts["inputs_undescribed"] else ""))  # fmt: skip
    changed = counts["dropped_saved"] > 0
    return PassResult(changed=changed, summary=summary, counts=counts, graph=(new_fw, new_bw) if changed else None)

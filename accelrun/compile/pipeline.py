"""The compiler's stages, in the order a Dynamo graph goes through them, and the one pass driver.

    capture      Dynamo traces the user's code into a torch-level graph    (torch.compile)
    pre_grad     passes on that graph: pattern fusion into custom ops       (PassDriver)
    joint        passes on AOTAutograd's joint forward+backward graph       (PassDriver)
    partition    AOTAutograd's cut into forward and backward, then the
                 passes that decide what the backward recomputes           (PassDriver, on the pair)
    post_grad    passes on the forward and the backward graph each; the
                 last of them forms the fusion regions (partition_regions)  (PassDriver)
    lowering     each region to the first executor that claims it          (lower.lower_regions)
    runtime      the lowered graph as straight-line calls after its first
                 runs (fast_calls.runnable)

``AccelrunBackend`` (backend.py) wires the stages to torch's hooks; every pass of every stage goes
through ``PassDriver.run``: the graph is snapshotted, the pass runs, the result is linted, recorded
and dumped, and a pass that raises is skipped for that graph (an error under ``compile.strict``).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx

from accelrun.compile.activity import ACTIVITY
from accelrun.compile.dump import Dumper
from accelrun.compile.numerics import ForwardThenBackward, check_pass
from accelrun.compile.passes.base import (
    ConfiguredPass,
    GraphNotes,
    PassContext,
    PassResult,
    lint,
    passes_for_stage,
)
from accelrun.compile.record import CompileRecord, Fallback, PassRecord


class CompilerFallbackError(RuntimeError):
    """``compile.strict``: the compiler would have fallen back (a pass, a claim, a compile, a first call)."""


def one_line(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:240]


def checkpoint_bodies(gm: fx.GraphModule) -> list[str]:
    """Names of the submodules that are the bodies of ``gm``'s activation-checkpointed regions."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    bodies = (n.args[0] for n in gm.graph.nodes if hop is not None and n.op == "call_function" and n.target is hop)
    return list(dict.fromkeys(str(b.target) for b in bodies if isinstance(b, fx.Node) and b.op == "get_attr"))


def count_ops(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def generate_code(gm: fx.GraphModule) -> None:
    """Write ``gm``'s Python code from its graph now. torch's GraphModules are mostly lazy (recompile()
    only marks them), which would put off a graph that cannot be written as Python to whoever calls it
    next, outside the pass driver's fallbacks; reading ``code`` writes it."""
    gm.recompile()
    gm.code  # noqa: B018 (read for its effect)


@dataclass
class GraphSnapshot:
    """A graph as it was before a stage's passes, to go back to if one raises half way through an
    in-place rewrite or leaves code that cannot be written. Only the graph is copied here (nodes and
    meta dicts; values shared); the module, whose construction regenerates its Python code, is built in
    ``restore``, which only a failure needs: before 2026-12-02 every pass of every graph paid that code
    generation (0.3 s of a cold step)."""

    graph: fx.Graph
    # The module's top-level attributes the graph's get_attr / call_module nodes start from, as they were.
    attributes: dict[str, Any]
    meta: dict[str, Any]
    training: bool

    def restore(self) -> fx.GraphModule:
        # A module as root, not the dict: torch then copies each dotted target into modules of the new
        # GraphModule's own, where from a dict it would write into the user's submodules.
        root = torch.nn.Module()
        for name, value in self.attributes.items():
            object.__setattr__(root, name, value)  # as plain attributes: read back as they were
        # A copy each time: the module takes the graph it is given as its own, and passes rewrite it.
        gm = fx.GraphModule(root, copy_graph(self.graph))
        gm.meta, gm.training = dict(self.meta), self.training
        return gm


def copy_graph(old: fx.Graph) -> fx.Graph:
    """A copy of ``old`` (nodes and their meta dicts copied, values shared). Far cheaper than a deepcopy
    of the fake tensors."""
    graph = fx.Graph()
    # Not a deepcopy: that rebuilds the pytree specs' LeafSpecs, which torch deprecates with a FutureWarning
    # printed on every compiled run. The specs are frozen, so sharing them is safe; only the list is copied.
    graph._codegen = copy.copy(old._codegen)
    if (info := getattr(graph._codegen, "pytree_info", None)) is not None:
        graph._codegen.pytree_info = info._replace(orig_args=list(info.orig_args))
    value, old_output = graph.graph_copy(old, {}, return_output_node=True)
    graph.output(value).meta = copy.copy(old_output.meta)
    return graph


def graph_snapshot(gm: fx.GraphModule) -> GraphSnapshot:
    """``gm`` as it is now, to restore (any number of times) if a later rewrite fails."""
    graph = copy_graph(gm.graph)
    tops = {str(n.target).split(".")[0] for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    attributes = {name: getattr(gm, name) for name in tops}
    return GraphSnapshot(graph, attributes, dict(getattr(gm, "meta", {})), gm.training)


class _Unit(Protocol):
    """What a stage's passes rewrite: one graph, or the partition stage's (forward, backward) pair."""

    def ops(self) -> int: ...
    def snapshot(self) -> Callable[[], _Unit]: ...  # gives back the unit as it is now
    def value(self) -> Any: ...  # what the pass function receives
    def after(self, result: PassResult, pass_name: str) -> _Unit: ...  # the rewritten unit, linted
    def finish(self) -> None: ...  # once after the stage's passes: the modules' code matches their graphs
    def dump(self, dumper: Dumper, pass_name: str, changed: bool) -> None: ...
    def runner(self) -> Any: ...  # what compile.debug_numerics runs before and after a pass, or None


@dataclass
class _OneGraph:
    gm: fx.GraphModule
    name: str

    def ops(self) -> int:
        return count_ops(self.gm)

    def snapshot(self) -> Callable[[], _OneGraph]:
        saved = graph_snapshot(self.gm)
        return lambda: _OneGraph(saved.restore(), self.name)

    def value(self) -> fx.GraphModule:
        return self.gm

    def after(self, result: PassResult, pass_name: str) -> _OneGraph:
        gm = result.graph if result.graph is not None else self.gm
        try:
            lint(gm)
        except Exception as e:
            raise RuntimeError(f"pass {pass_name!r} left a malformed graph in {self.name}: {e}") from e
        return _OneGraph(gm, self.name)

    def finish(self) -> None:
        # Once per stage, not per pass: nothing runs the module between passes (a dump prints the graph).
        generate_code(self.gm)

    def dump(self, dumper: Dumper, pass_name: str, changed: bool) -> None:
        if changed:
            dumper.graph(self.name, pass_name, self.gm)

    def runner(self) -> fx.GraphModule:
        return self.gm


@dataclass
class _ForwardBackward:
    fw: fx.GraphModule
    bw: fx.GraphModule
    name: str  # the Dynamo graph's name: its graphs dump as <name>.forward and <name>.backward
    # What runs the pair as the joint graph it was cut from (compile.debug_numerics): AOTAutograd's count of
    # the forward's own outputs and the joint graph's input names.
    num_fwd_outputs: int | None = None
    joint_names: list[str] | None = None

    def ops(self) -> int:
        return count_ops(self.fw) + count_ops(self.bw)

    def snapshot(self) -> Callable[[], _ForwardBackward]:
        fw, bw = graph_snapshot(self.fw), graph_snapshot(self.bw)
        return lambda: _ForwardBackward(fw.restore(), bw.restore(), self.name, self.num_fwd_outputs, self.joint_names)

    def value(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        return self.fw, self.bw

    def after(self, result: PassResult, pass_name: str) -> _ForwardBackward:
        fw, bw = result.graph if result.graph is not None else (self.fw, self.bw)
        lint(fw), lint(bw)
        return _ForwardBackward(fw, bw, self.name, self.num_fwd_outputs, self.joint_names)

    def finish(self) -> None:
        generate_code(self.fw), generate_code(self.bw)

    def dump(self, dumper: Dumper, pass_name: str, changed: bool) -> None:
        dumper.graph(f"{self.name}.forward", f"partition_{pass_name}", self.fw)
        dumper.graph(f"{self.name}.backward", f"partition_{pass_name}", self.bw)

    def runner(self) -> ForwardThenBackward | None:
        if self.num_fwd_outputs is None or self.joint_names is None:
            return None
        return ForwardThenBackward(self.fw, self.bw, self.num_fwd_outputs, self.joint_names)


class PassDriver:
    """Runs a stage's configured passes over a graph; the only place a pass is called."""

    def __init__(self, passes: list[ConfiguredPass], record: CompileRecord, dumper: Dumper, *, strict: bool,
                 debug_numerics: bool) -> None:  # fmt: skip
        self.passes, self.record, self.dumper = passes, record, dumper
        self.strict, self.debug_numerics = strict, debug_numerics

    def run_graph(self, stage: str, gm: fx.GraphModule, graph_name: str, kind: str,
                  example_inputs: list[Any] | None, notes: GraphNotes,
                  check_inputs: list[Any] | None = None) -> fx.GraphModule:  # fmt: skip
        """``stage``'s passes over one graph (pre_grad, joint, post_grad). ``check_inputs``: what
        compile.debug_numerics runs the graph on where the passes are given no ``example_inputs`` (the
        joint graph's primals and tangents)."""
        self.dumper.graph(graph_name, "input", gm)
        unit = self._run(stage, _OneGraph(gm, graph_name), graph_name, PassContext(kind, example_inputs, notes),
                         example_inputs if check_inputs is None else check_inputs)
        if stage == "pre_grad":
            # Dynamo traces a ``checkpoint`` call into one higher-order op whose body is a submodule the
            # passes would not see: without this a checkpointed block trains (and reruns) unfused.
            for body in checkpoint_bodies(unit.gm):
                setattr(unit.gm, body, self.run_graph(stage, getattr(unit.gm, body), f"{graph_name}.{body}", kind,
                                                      None, notes))  # fmt: skip
        return unit.gm

    def run_pair(self, name: str, fw: fx.GraphModule, bw: fx.GraphModule, notes: GraphNotes,
                 joint: fx.GraphModule | None = None, joint_inputs: list[Any] | None = None,
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:  # fmt: skip
        """The partition stage's passes over AOTAutograd's (forward, backward) pair of Dynamo graph ``name``,
        cut from ``joint`` (whose inputs compile.debug_numerics runs the pair on)."""
        names = None if joint is None else [p.name for p in joint.graph.find_nodes(op="placeholder")]
        pair = _ForwardBackward(fw, bw, name, notes.num_fwd_outputs, names)
        unit = self._run("partition", pair, f"{name}.joint", PassContext("joint", notes=notes), joint_inputs)
        return unit.fw, unit.bw

    def _run(self, stage: str, unit: Any, graph_name: str, ctx: PassContext, check_inputs: list[Any] | None) -> Any:
        passes = passes_for_stage(self.passes, stage)  # type: ignore[arg-type]
        if not passes:
            unit.finish()
            return unit
        # One copy of the stage's input, not one per pass (44 graph copies were a tenth of a cold
        # compile's passes): a pass that raises half way through is undone by going back to the input
        # and running again the passes that had succeeded, which are deterministic.
        stage_input = unit.snapshot()
        done: list[ConfiguredPass] = []
        changed_by: list[str] = []
        for p in passes:
            checked = self.debug_numerics and check_inputs is not None and unit.runner() is not None
            before_copy = None
            if checked:
                with warnings.catch_warnings():  # torch's pytree spec of a joint graph warns when copied
                    warnings.simplefilter("ignore", FutureWarning)
                    before_copy = copy.deepcopy(unit.runner())
            t0 = time.perf_counter()
            before = unit.ops()
            ACTIVITY.doing(f"{graph_name}: {'' if graph_name.endswith(stage) else stage + ' '}pass {p.name} ({before:,} ops)")
            try:
                # One context for every pass: what one pass notes (the next region id) the next reads.
                result = p.spec.fn(unit.value(), p.options, ctx)
                unit = unit.after(result, p.name)
                if checked:
                    unit.finish()  # the check runs the module
            except Exception as e:  # the graph as it was before the pass goes on; the run does not stop
                self._failed(graph_name, stage, p, before, e, time.perf_counter() - t0)
                try:
                    unit = self._replay(stage_input(), done, ctx)
                except Exception as again:  # noqa: BLE001 (a pass that is not deterministic)
                    why = f"raised when run again after {p.name!r} failed (not deterministic?)"
                    return self._stage_input_goes_on(stage_input, graph_name, stage, changed_by, again, why)
                continue
            done.append(p)
            noted = self._noted(graph_name, stage, p, before, unit.ops(), result, time.perf_counter() - t0)
            changed_by += [p.name] if result.changed else []
            if before_copy is not None:
                noted.numerics = check_pass(f"pass {p.name!r}", before_copy, unit.runner(), check_inputs)
            unit.dump(self.dumper, p.name, result.changed)
        try:
            unit.finish()
        except Exception as e:  # a pass left a graph that lints but cannot be written as Python
            why = "the graph they left cannot be generated as Python"
            return self._stage_input_goes_on(stage_input, graph_name, stage, changed_by, e, why)
        return unit

    def _stage_input_goes_on(self, stage_input: Callable[[], Any], graph: str, stage: str, changed_by: list[str],
                             e: Exception, why: str) -> Any:  # fmt: skip
        """The stage's input, its passes skipped for this graph, and the fallback that says so."""
        unit = stage_input()
        unit.finish()
        self._stage_failed(graph, stage, changed_by, e, why)
        return unit

    @staticmethod
    def _replay(unit: Any, done: list[ConfiguredPass], ctx: PassContext) -> Any:
        """``unit`` (the stage's input) after the passes in ``done`` again, unrecorded: what the graph was
        before the pass that failed. (One that succeeded once and raises now is not deterministic: the
        caller then sends the stage's input on, all its passes skipped.)"""
        for p in done:
            unit = unit.after(p.spec.fn(unit.value(), p.options, ctx), p.name)
        return unit

    def _stage_failed(self, graph: str, stage: str, changed_by: list[str], e: Exception, why: str) -> None:
        what = f"{stage} passes ({', '.join(changed_by) or 'none changed it'})"
        reason = f"{why}: {one_line(e)}"
        if self.strict:
            raise CompilerFallbackError(f"{what} on {graph}: {reason} (compile.strict is on)") from e
        self.record.fallbacks.append(Fallback(graph, "pass", what, f"{reason}; all skipped for this graph"))

    def _failed(self, graph: str, stage: str, p: ConfiguredPass, before: int, e: Exception, seconds: float) -> None:
        reason = one_line(e)
        if self.strict:
            raise CompilerFallbackError(f"pass {p.name!r} failed on {graph}: {reason} (compile.strict is on)") from e
        self.record.fallbacks.append(Fallback(graph, "pass", p.name, f"{reason}; skipped for this graph"))
        self.record.passes.append(PassRecord(
            graph=graph, stage=stage, name=p.name, ops_before=before, ops_after=before,
            summary=f"FAILED, skipped for this graph: {reason}", counts={"failed": 1}, seconds=round(seconds, 4),
        ))  # fmt: skip

    def _noted(self, graph: str, stage: str, p: ConfiguredPass, before: int, after: int, result: PassResult,
               seconds: float) -> PassRecord:  # fmt: skip
        counts = dict(result.counts)
        if result.changed:
            counts.setdefault("changed", 1)
        noted = PassRecord(graph=graph, stage=stage, name=p.name, ops_before=before, ops_after=after,
                           summary=result.summary, counts=counts, seconds=round(seconds, 4), detail=result.detail)
        self.record.passes.append(noted)
        return noted

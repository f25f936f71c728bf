"""Whether the compiled graphs replay as CUDA graphs (``compile.cuda_graphs``), and why not.

Inductor's ``reduce-overhead``: a training step of a small model on an H100 is a few hundred kernel
launches of a few microseconds each, and the host's launching sets the pace. Captured once as a CUDA
graph, a compiled forward or backward becomes one launch. accelrun captures each compiled graph
(forward and backward apart, as Inductor's CUDA graph trees do), not the whole step: the optimizer
step, gradient clipping and FSDP's hooks stay eager and unchanged.

The decision is made twice. For the run (``decide_for_run``): the mode, the device, the ranks, the
data. For each graph (``decide_for_graph``): its shapes, its collectives, data-dependent ops. Either
can say no, with a one-line reason that the run's compiled line and report show. Under ``auto`` the
runner that captures and replays (``cuda_graphs.py``; this module is torch-free) has the last word:
a graph whose timed replay is no faster than its timed eager call runs eagerly, with both times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class CudaGraphMode(str, Enum):
    AUTO = "auto"  # on where they apply: CUDA, one rank, static shapes
    ON = "on"  # as auto, but a graph that cannot be captured is a compiler fallback (a warning; strict: an error)
    OFF = "off"


@dataclass(frozen=True)
class CudaGraphDecision:
    use: bool
    reason: str  # why not (one line), or what they apply to

    @classmethod
    def no(cls, reason: str) -> CudaGraphDecision:
        return cls(False, reason)


NOT_REQUESTED = CudaGraphDecision.no("compile.cuda_graphs = off")


def decide_for_run(mode: CudaGraphMode | str, *, device_type: str, ranks: int = 1,
                   document_packing: bool = False, backend: str = "accelrun") -> CudaGraphDecision:  # fmt: skip
    """The run's answer, before any graph exists. ``ranks``: processes in the job."""
    mode = CudaGraphMode(mode)
    if mode is CudaGraphMode.OFF:
        return NOT_REQUESTED
    if backend != "accelrun":
        return CudaGraphDecision.no(f"compile.backend = {backend}: accelrun captures the graphs it compiled")
    if device_type != "cuda":
        return CudaGraphDecision.no(f"the run is on {device_type}: CUDA graphs need a CUDA device")
    if ranks > 1:
        # FSDP's gathers free and reallocate the blocks' parameters every step (a new address a step: a
        # recapture every call), and the pipeline's sends and TP's eager collectives sit between graphs.
        return CudaGraphDecision.no(f"{ranks} ranks: the collectives between the compiled graphs (FSDP, "
                                    "TP, pipeline sends) are not captured")  # fmt: skip
    if document_packing:
        return CudaGraphDecision.no("data.packing = document: attention reads each batch's document spans on "
                                    "the host (data-dependent control flow)")  # fmt: skip
    return CudaGraphDecision(True, "CUDA, one rank")


@dataclass(frozen=True)
class GraphFacts:
    """What ``decide_for_graph`` needs to know about one compiled graph (read by ``cuda_graphs.graph_facts``)."""

    devices: frozenset[str]  # device types of its inputs
    symbolic_shapes: bool  # an input's size or stride is symbolic (Dynamo's dynamic shapes)
    collectives: int  # functional collectives in the graph
    data_dependent: tuple[str, ...] = ()  # ops whose output size or value the host must read


def decide_for_graph(run: CudaGraphDecision, facts: GraphFacts) -> CudaGraphDecision:
    if not run.use:
        return run
    if "cpu" in facts.devices or not facts.devices:
        return CudaGraphDecision.no("the graph takes CPU tensors" if facts.devices else "the graph takes no tensors")
    if facts.symbolic_shapes:
        return CudaGraphDecision.no("dynamic shapes: a capture holds one set of sizes")
    if facts.collectives:
        return CudaGraphDecision.no(f"{facts.collectives} collective(s) in the graph")
    if facts.data_dependent:
        return CudaGraphDecision.no(f"data-dependent ops ({', '.join(sorted(set(facts.data_dependent)))})")
    return CudaGraphDecision(True, "static shapes, no collectives")


@dataclass
class CudaGraphsReport:
    """What the compile record says about CUDA graphs: the run's decision, and per graph what happened."""

    mode: CudaGraphMode = CudaGraphMode.OFF
    run: CudaGraphDecision = NOT_REQUESTED
    captured: dict[str, int] = field(default_factory=dict)  # graph name -> captures (one per input layout)
    replays: int = 0
    declined: dict[str, str] = field(default_factory=dict)  # graph name -> why it runs without
    # graph name -> (ms of a timed eager call, ms of a timed replay, copies included): what auto decided on
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)
    capture: Any = field(default=None, repr=False, compare=False)  # cuda_graphs' shared pool, made on first use

    def line(self) -> str:
        """For the terminal's compiled line: empty when off, or when auto found the run unsuited (a CPU
        run need not hear about CUDA every time; the report's table says it, see ``row``)."""
        if self.mode is CudaGraphMode.OFF or (self.mode is CudaGraphMode.AUTO and not self.run.use):
            return ""
        if not self.run.use:
            return f"CUDA graphs off ({self.run.reason})"
        n = sum(self.captured.values())
        out = f"CUDA graphs: {len(self.captured)} graph(s), {n} capture(s)"
        if self.declined:
            first = next(iter(self.declined.items()))
            out += f", {len(self.declined)} without ({first[0]}: {first[1]})"
        return out

    def row(self) -> str:
        """For the report's table: always says what happened, and why not where they did not apply."""
        if not self.run.use:
            return f"off: {self.run.reason}"
        return self.line() or "on: no graph compiled yet"

    def summary(self) -> dict:
        return {"mode": self.mode.value, "run": {"use": self.run.use, "reason": self.run.reason},
                "captured": dict(self.captured), "replays": self.replays, "declined": dict(self.declined),
                "timings_ms": {name: list(t) for name, t in self.timings.items()}, "row": self.row()}

"""Replaying a compiled graph as a CUDA graph (the policy is ``cuda_graph_policy.py``).

``CudaGraphRunner`` wraps what runs one compiled forward or backward. For each kind of call (the
inputs' sizes, strides and dtypes, and the addresses of the parameters it reads) it runs the graph
eagerly ``warmup_calls`` times (cuBLAS and Triton load their kernels and workspaces outside any
capture), then captures it once into the runner's private memory pool, with the call's inputs copied
into static buffers that belong to the capture. From then on a call copies its inputs into those
buffers, replays, and reads the outputs out (copies), as torch.cuda.graphs documents:

- parameters are used in place, not copied (they do not move between steps); a parameter that moved
  (a new address) is a new kind of call, so the blocks of a model (one graph, a parameter set each)
  get one capture each;
- outputs are copied out because the next replay writes the same memory; a forward's saved
  activations are among them. The price: one extra copy of each graph's inputs and outputs a step.
  An output that views an input (a forward saves its input for the backward) is not copied: it is
  made again as the same view of the caller's tensor;
- anything that fails while capturing (an op that synchronises with the host) sends the graph back to
  eager for the rest of the run, with the reason;
- a graph's first kind of call is measured, each side from an idle device and past its first-time
  costs: its last eager warm-up call (the first one compiles, tunes and allocates) and its second
  replay (the first uploads the graph), copies in and out included. Under ``auto`` a replay that is
  not clearly faster sends the graph back to eager, with both times. A launch-bound graph (the debug
  Llama on an H200: a bf16 step 14.6 ms eager, 9.7 ms replayed) keeps its captures; a large one, where
  the GPU sets the pace and the copies of the saved activations are pure cost (an 8-layer dim-2048
  Llama: 0.80x Inductor's step replayed, and 19 GiB of GPU memory against 12), does not. ``on`` keeps
  every capture.

The CUDA calls are behind ``GraphCapture`` so that the CPU tests can give a fake one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx, nn

from accelrun.compile.cuda_graph_policy import (
    CudaGraphDecision,
    CudaGraphMode,
    CudaGraphsReport,
    GraphFacts,
    decide_for_graph,
)
from accelrun.compile.fast_calls import RECORDED_CALLS

# Eager calls per kind of call before it is captured, the last one timed (see below). One more than
# fast_calls' recorded calls: those run through fx's interpreter and the last rewrites the graph, so
# timed, they would make eager look slower than it is and keep captures that cost time.
WARMUP_CALLS = RECORDED_CALLS + 1
MAX_CAPTURES = 256  # kinds of call per graph (a model's blocks: one each) before giving up on it
# Under auto, a graph keeps its captures only if its timed replay (copies included) took at most this
# share of its timed eager call: one call each, so a margin for their noise.
KEEP_IF_REPLAY_UNDER = 0.9
TIMED_REPLAY = 2  # the first replay of a new graph also uploads it to the device

# Ops whose output's size or value the host reads: a capture would freeze the value it saw.
DATA_DEPENDENT_OPS = ("nonzero", "_local_scalar_dense", "masked_select", "unique", "item", "bincount")


class GraphCapture(Protocol):
    """What the runner needs of CUDA: capture a call into a graph (in one memory pool), replay it."""

    def capture(self, fn: Callable[..., Any], inputs: list[Any]) -> tuple[Any, Any]: ...  # (graph, outputs)
    def replay(self, graph: Any) -> None: ...
    # run's result and its milliseconds on the device, from an idle device (launching included)
    def timed(self, run: Callable[[], Any]) -> tuple[Any, float]: ...


class TorchCudaGraphs:
    """``torch.cuda.CUDAGraph`` captures sharing one private pool: replays run in the order the graphs
    were captured, on one stream, and every output is copied out before the next replay, so a later
    capture may reuse an earlier one's temporaries (not its outputs: the runner keeps those)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()  # every capture's, so that its lazy state is made once, outside

    def capture(self, fn: Callable[..., Any], inputs: list[Any]) -> tuple[Any, Any]:
        # One call on the capture stream first, as torch.cuda.graphs asks: what is made lazily per
        # stream (cuBLAS's workspace, a Triton region's scratch) is made there, not inside the capture.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn(*inputs)
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local, as Inductor's CUDA graph trees: CUDA calls of other threads (a data loader's
        # pinned copies) during the capture are not an error of this one.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            outputs = fn(*inputs)
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()

    def timed(self, run: Callable[[], Any]) -> tuple[Any, float]:
        # From an idle device, so that a launch-bound graph's time is its host's launching.
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = run()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end)


@dataclass
class _Capture:
    graph: Any
    buffers: list[torch.Tensor | None]  # a static buffer per copied input; None: used in place
    outputs: Any
    # Per output: None = copied out; ("static",) = a view of a parameter, returned as it is; (i, size,
    # stride, offset) = a view of copied input i (a forward saves its input for the backward), made
    # again on the caller's tensor so that it aliases what it aliased without the capture.
    aliases: list[tuple | None]


def _is_static(value: Any) -> bool:
    """Used in place rather than copied: a parameter (or a tensor that views one)."""
    return isinstance(value, nn.Parameter) or (isinstance(value, torch.Tensor) and isinstance(value._base, nn.Parameter))


def _kind(args: Sequence[Any]) -> tuple:
    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.data_ptr() if _is_static(a) else None))
        else:
            key.append(("value", a))
    return tuple(key)


class CudaGraphRunner:
    """``fn(*args) -> outputs`` (a tuple or list of tensors, None or numbers), replayed from CUDA graphs
    once warm. ``report`` counts captures and replays and keeps why a graph went back to eager."""

    def __init__(self, fn: Callable[..., Any], name: str, capture: GraphCapture, report: CudaGraphsReport,
                 warmup_calls: int = WARMUP_CALLS, max_captures: int = MAX_CAPTURES) -> None:  # fmt: skip
        self.fn, self.name, self.capturer, self.report = fn, name, capture, report
        self.warmup_calls, self.max_captures = warmup_calls, max_captures
        self.captures: dict[tuple, _Capture] = {}
        self.warm: dict[tuple, int] = {}
        self.eager_reason: str | None = None  # set once: the graph runs eagerly from then on
        # The measurement, of the first kind of call only: (kind, its timed eager call's ms), then its
        # replays counted up to the timed one.
        self.measured: tuple[tuple, float] | None = None
        self.replays_measured = 0

    def __call__(self, *args: Any) -> Any:
        if self.eager_reason is not None:
            return self.fn(*args)
        kind = _kind(args)
        cap = self.captures.get(kind)
        if cap is None:
            warm = self.warm.get(kind, 0)
            if warm < self.warmup_calls:
                self.warm[kind] = warm + 1
                if warm == self.warmup_calls - 1 and warm > 0 and self.measured is None:
                    # its last warm-up call: the first-time costs were paid by the ones before
                    out, eager_ms = self.capturer.timed(lambda: self.fn(*args))
                    self.measured = (kind, eager_ms)
                    return out
                return self.fn(*args)
            if len(self.captures) >= self.max_captures:
                return self._give_up(f"more than {self.max_captures} kinds of call (sizes, parameter sets)", args)
            try:
                cap = self._capture(args)
            except Exception as e:  # noqa: BLE001  (the run goes on eagerly; the reason is reported)
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                return self._give_up(f"capture failed: {type(e).__name__}: {first}"[:200], args)
            self.captures[kind] = cap
            self.report.captured[self.name] = self.report.captured.get(self.name, 0) + 1
        if self.measured is not None and kind == self.measured[0] and self.replays_measured < TIMED_REPLAY:
            self.replays_measured += 1
            if self.replays_measured == TIMED_REPLAY:
                return self._measured_replay(cap, args, self.measured[1])
        return self._replay(cap, args)

    def _replay(self, cap: _Capture, args: Sequence[Any]) -> Any:
        for buf, a in zip(cap.buffers, args, strict=True):
            if buf is not None:
                buf.copy_(a)
        self.capturer.replay(cap.graph)
        self.report.replays += 1
        return _read_out(cap, args)

    def _measured_replay(self, cap: _Capture, args: Sequence[Any], eager_ms: float) -> Any:
        """A replay timed against the eager call; under auto, one that is not clearly faster sends the
        graph back to eager (this call's outputs are good either way)."""
        out, replay_ms = self.capturer.timed(lambda: self._replay(cap, args))
        self.report.timings[self.name] = (round(eager_ms, 3), round(replay_ms, 3))
        if self.report.mode is CudaGraphMode.AUTO and replay_ms > eager_ms * KEEP_IF_REPLAY_UNDER:
            self.report.captured.pop(self.name, None)
            self._decline(f"a replay took {replay_ms:.2f} ms against {eager_ms:.2f} ms eager (the copies "
                          "in and out cost what the launches save)")  # fmt: skip
        return out

    def _capture(self, args: Sequence[Any]) -> _Capture:
        for a in args:
            if isinstance(a, torch.Tensor) and not _is_static(a) and any(
                    st == 0 and n > 1 for n, st in zip(a.shape, a.stride(), strict=True)):
                # A buffer of these strides cannot be written (copy_ refuses overlapping elements), and
                # one of other strides would break the layouts the compiled graph has fixed.
                raise ValueError(f"an input is expanded (strides {a.stride()}), not copied into a static buffer")
        buffers = [_static_copy(a) if isinstance(a, torch.Tensor) and not _is_static(a) else None for a in args]
        inputs = [b if b is not None else a for b, a in zip(buffers, args, strict=True)]
        graph, outputs = self.capturer.capture(self.fn, inputs)
        return _Capture(graph, buffers, outputs, [_alias(o, inputs, buffers) for o in _flat(outputs)])

    def _decline(self, reason: str) -> None:
        self.eager_reason = reason
        self.report.declined[self.name] = reason
        self.captures.clear()  # their pool memory goes back with them

    def _give_up(self, reason: str, args: Sequence[Any]) -> Any:
        self._decline(reason)
        return self.fn(*args)


def _flat(outputs: Any) -> list[Any]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    """A buffer with ``t``'s strides (so that a view of it maps back onto ``t``, and a graph compiled
    for those strides reads it right), holding its values."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _alias(out: Any, inputs: list[Any], buffers: list[torch.Tensor | None]) -> tuple | None:
    if not isinstance(out, torch.Tensor):
        return None
    storage = out.untyped_storage().data_ptr()
    for i, (t, buf) in enumerate(zip(inputs, buffers, strict=True)):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage:
            if buf is None:
                return ("static",)
            return (i, tuple(out.shape), out.stride(), out.storage_offset() - buf.storage_offset())
    return None


def _read_out(cap: _Capture, args: Sequence[Any]) -> Any:
    copied = []
    for o, alias in zip(_flat(cap.outputs), cap.aliases, strict=True):
        if not isinstance(o, torch.Tensor):
            copied.append(o)
        elif alias is None:
            copied.append(_static_copy(o))  # clone() would make a non-dense output (a column slice) contiguous
        elif alias[0] == "static":
            copied.append(o)
        else:
            i, size, stride, offset = alias
            copied.append(args[i].as_strided(size, stride, args[i].storage_offset() + offset))
    if isinstance(cap.outputs, (list, tuple)):
        return copied if isinstance(cap.outputs, list) else tuple(copied)
    return copied[0]


def graph_facts(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> GraphFacts:
    """What ``decide_for_graph`` reads, from a graph and its (fake) example inputs."""
    devices, symbolic = set(), False
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            devices.add(t.device.type)
            symbolic |= any(not isinstance(s, int) for s in (*t.shape, *t.stride()))
        elif isinstance(t, torch.SymInt):
            symbolic = True
    collectives, data_dependent = 0, []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        target = str(n.target)
        if "_c10d_functional" in target:
            collectives += 1
        name = getattr(n.target, "__name__", target).split(".")[0]
        if name in DATA_DEPENDENT_OPS:
            data_dependent.append(name)
    return GraphFacts(frozenset(devices), symbolic, collectives, tuple(data_dependent))


def wants_cuda_graphs(name: str, facts: GraphFacts, report: CudaGraphsReport) -> bool:
    """Whether graph ``name`` replays from CUDA graphs (the run and the graph allow it); where the run
    asked for them and this graph cannot, the reason goes in ``report.declined``."""
    if not report.run.use:
        return False
    decision: CudaGraphDecision = decide_for_graph(report.run, facts)
    if not decision.use:
        report.declined[name] = decision.reason
    return decision.use


def with_cuda_graphs(fn: Callable[..., Any], name: str, gm: fx.GraphModule, example_inputs: Sequence[Any],
                     report: CudaGraphsReport, capture: GraphCapture | None = None) -> Callable[..., Any]:  # fmt: skip
    """``fn`` replayed from CUDA graphs where the run and this graph allow it; else ``fn`` itself."""
    if not wants_cuda_graphs(name, graph_facts(gm, example_inputs), report):
        return fn
    return CudaGraphRunner(fn, name, capture or shared_capture(report), report)


def shared_capture(report: CudaGraphsReport) -> GraphCapture:
    """One pool for every graph of one compile record (one model): see ``TorchCudaGraphs``."""
    if report.capture is None:
        report.capture = TorchCudaGraphs()
    return report.capture

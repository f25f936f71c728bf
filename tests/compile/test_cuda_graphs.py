"""compile.cuda_graphs on the CPU: when CUDA graphs apply (and each reason they do not), and the
capture/replay wrapper driven by a fake CUDA graph that, like a real one, replays the captured
kernels into the captured (static) memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from accelrun.compile.cuda_graph_policy import (
    CudaGraphDecision,
    CudaGraphMode,
    CudaGraphsReport,
    GraphFacts,
    decide_for_graph,
    decide_for_run,
)
from accelrun.compile.cuda_graphs import WARMUP_CALLS, CudaGraphRunner, graph_facts, with_cuda_graphs

ON = CudaGraphDecision(True, "CUDA, one rank")


class FakeGraphs:
    """A CUDA graph stand-in: capture runs ``fn`` once on the static inputs (as the capture's warm pass
    would allocate its outputs); replay runs it again on the same inputs and writes the results into
    the captured outputs' memory, which is what a replay does."""

    def __init__(self, fail: str | None = None, eager_ms: float = 4.0, replay_ms: float = 1.0) -> None:
        self.captures, self.replays, self.fail = 0, 0, fail
        self.eager_ms, self.replay_ms = eager_ms, replay_ms  # what the device's events would say
        self.timed_calls = 0

    def capture(self, fn, inputs):
        if self.fail:
            raise RuntimeError(self.fail)
        self.captures += 1
        fn(*inputs)  # the call on the capture stream before the capture, on the static inputs
        outputs = fn(*inputs)
        return (fn, inputs, outputs), outputs

    def timed(self, run):
        self.timed_calls += 1
        replays = self.replays
        out = run()
        return out, self.replay_ms if self.replays > replays else self.eager_ms

    def replay(self, graph):
        fn, inputs, outputs = graph
        self.replays += 1
        with torch.no_grad():  # compiled graphs run under no_grad (AOTAutograd's autograd.Function)
            fresh_outputs = fn(*inputs)
        for static, fresh in zip(outputs, fresh_outputs, strict=True):
            if isinstance(static, torch.Tensor):  # a backward returns None for inputs without gradients
                with torch.no_grad():
                    static.copy_(fresh)


def counted(fn):
    calls = []

    def run(*args):
        calls.append(args)
        return fn(*args)

    return run, calls


def runner(fn, graphs=None, mode=CudaGraphMode.AUTO, **kw):
    report = CudaGraphsReport(mode, ON)
    graphs = graphs or FakeGraphs()
    return CudaGraphRunner(fn, "g0.forward", graphs, report, **kw), graphs, report


# -- the decision -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, use, words", [
    (dict(mode="auto", device_type="cuda"), True, "CUDA, one rank"),
    (dict(mode="on", device_type="cuda"), True, "CUDA, one rank"),
    (dict(mode="off", device_type="cuda"), False, "compile.cuda_graphs = off"),
    (dict(mode="auto", device_type="cpu"), False, "the run is on cpu"),
    (dict(mode="auto", device_type="cuda", ranks=2), False, "2 ranks"),
    (dict(mode="auto", device_type="cuda", document_packing=True), False, "data.packing = document"),
    (dict(mode="auto", device_type="cuda", backend="inductor"), False, "compile.backend = inductor"),
])  # fmt: skip
def test_the_run_decides_with_one_reason(kwargs, use, words):
    d = decide_for_run(**kwargs)
    assert d.use is use and words in d.reason and "\n" not in d.reason


@pytest.mark.parametrize("facts, words", [
    (GraphFacts(frozenset({"cpu"}), False, 0), "CPU tensors"),
    (GraphFacts(frozenset({"cuda"}), True, 0), "dynamic shapes"),
    (GraphFacts(frozenset({"cuda"}), False, 2), "2 collective(s)"),
    (GraphFacts(frozenset({"cuda"}), False, 0, ("nonzero",)), "data-dependent ops (nonzero)"),
])  # fmt: skip
def test_a_graph_declines_with_its_reason(facts, words):
    d = decide_for_graph(ON, facts)
    assert not d.use and words in d.reason
    assert decide_for_graph(ON, GraphFacts(frozenset({"cuda"}), False, 0)).use
    off = CudaGraphDecision.no("the run is on cpu")
    assert decide_for_graph(off, GraphFacts(frozenset({"cuda"}), False, 0)) is off


def test_graph_facts_reads_devices_collectives_and_host_reads():
    def f(x):
        return torch.nonzero(x) + 1

    gm = fx.symbolic_trace(f)
    facts = graph_facts(gm, [torch.ones(3)])
    assert facts.devices == {"cpu"} and facts.data_dependent == ("nonzero",) and not facts.symbolic_shapes

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    fake = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(torch.ones(4, 3), symbolic_context=dynamic)
    assert graph_facts(fx.symbolic_trace(lambda x: x + 1), [fake]).symbolic_shapes


def test_with_cuda_graphs_keeps_the_graph_eager_and_says_why():
    report = CudaGraphsReport(CudaGraphMode.AUTO, ON)
    gm = fx.symbolic_trace(lambda x: x * 2)
    fn = lambda x: (x * 2,)  # noqa: E731
    assert with_cuda_graphs(fn, "g0.forward", gm, [torch.ones(2)], report) is fn
    assert report.declined == {"g0.forward": "the graph takes CPU tensors"}
    assert "1 without (g0.forward: the graph takes CPU tensors)" in report.line()
    off = CudaGraphsReport(CudaGraphMode.AUTO, CudaGraphDecision.no("the run is on cpu"))
    assert with_cuda_graphs(fn, "g0.forward", gm, [torch.ones(2)], off) is fn and not off.declined
    assert off.line() == ""  # auto on a CPU run: quiet in the terminal, said in the report's table
    assert off.row() == "off: the run is on cpu"
    asked = CudaGraphsReport(CudaGraphMode.ON, CudaGraphDecision.no("the run is on cpu"))
    assert asked.line() == "CUDA graphs off (the run is on cpu)"
    assert CudaGraphsReport().line() == ""  # off and not asked for: nothing to say


def test_the_key_reads_on_and_off_as_yaml_writes_them():
    """YAML 1.1 (and the command line's key=value) reads `on` and `off` as booleans."""
    from accelrun.config import load_config
    from tests.conftest import DEFAULT_CONFIG

    for value, want in (("on", "on"), ("off", "off"), ("auto", "auto"), ("true", "on")):
        assert load_config(DEFAULT_CONFIG, [f"compile.cuda_graphs={value}"]).config.compile.cuda_graphs == want
    assert load_config(DEFAULT_CONFIG, []).config.compile.cuda_graphs == "auto"


# -- capture and replay -----------------------------------------------------------------------------

def test_warm_up_then_capture_then_replays_copy_inputs_in_and_outputs_out():
    fn, calls = counted(lambda x, y: (x * y + 1, x.sum(0)))
    run, graphs, report = runner(fn, warmup_calls=1)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    first = run(x, y)  # the warm-up: eager, on the caller's tensors
    assert calls[0][0] is x and graphs.captures == 0
    x2, y2 = torch.randn(3, 4), torch.randn(3, 4)
    second = run(x2, y2)  # captured on static copies, then replayed
    assert graphs.captures == 1 and graphs.replays == 1
    static = run.captures[next(iter(run.captures))]
    assert all(b is not None for b in static.buffers) and static.buffers[0].data_ptr() != x2.data_ptr()
    torch.testing.assert_close(first, (x * y + 1, x.sum(0)), rtol=0, atol=0)
    torch.testing.assert_close(second, (x2 * y2 + 1, x2.sum(0)), rtol=0, atol=0)
    x3, y3 = torch.randn(3, 4), torch.randn(3, 4)
    third = run(x3, y3)  # no new capture: the new values reach the graph through the static buffers
    assert graphs.captures == 1 and graphs.replays == 2
    torch.testing.assert_close(third, (x3 * y3 + 1, x3.sum(0)), rtol=0, atol=0)
    # Read out: the next replay overwrites the static outputs, not what the caller holds.
    assert third[0].data_ptr() != static.outputs[0].data_ptr()
    run(torch.zeros(3, 4), torch.zeros(3, 4))
    torch.testing.assert_close(third[0], x3 * y3 + 1, rtol=0, atol=0)
    assert report.captured == {"g0.forward": 1} and report.replays == 3


def test_auto_keeps_a_graph_whose_replay_is_faster_and_says_so():
    """Timed: the last eager warm-up call (the first pays compiling and allocating) and the second
    replay (the first uploads the graph); nothing else."""
    fn, calls = counted(lambda x: (x * 2,))
    run, graphs, report = runner(fn, FakeGraphs(eager_ms=4.0, replay_ms=1.0))
    for i in range(WARMUP_CALLS + 4):
        torch.testing.assert_close(run(torch.full((2,), float(i)))[0], torch.full((2,), 2.0 * i), rtol=0, atol=0)
        if i == WARMUP_CALLS - 1:
            assert graphs.timed_calls == 1 and graphs.captures == 0  # the last warm-up call
    assert graphs.timed_calls == 2 and graphs.replays == 4
    assert report.captured == {"g0.forward": 1} and report.timings == {"g0.forward": (4.0, 1.0)}
    assert report.summary()["timings_ms"] == {"g0.forward": [4.0, 1.0]}


def test_the_timed_eager_call_runs_the_graph_s_settled_code():
    """What the runner wraps in a compiled step is fast_calls' runnable graph, whose first calls record
    its views through fx's interpreter and then rewrite it: the timed warm-up call comes after those."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from accelrun.compile.fast_calls import runnable

    # An ATen graph with its values' layouts, as a lowered graph has: a view chain, then an op.
    gm = make_fx(lambda x: (x.view(2, 4).permute(1, 0).reshape(8) * 2,), tracing_mode="fake")(torch.zeros(8))
    graph = runnable(gm)
    settled_when_timed = []

    class Graphs(FakeGraphs):
        def timed(self, run):
            settled_when_timed.append(graph._run != graph._record)
            return super().timed(run)

    run, graphs, report = runner(graph, Graphs())
    for i in range(6):
        torch.testing.assert_close(run(torch.full((8,), float(i)))[0], torch.full((8,), 2.0 * i), rtol=0, atol=0)
    assert graph.collapsed >= 1  # the view chain became one reinterpretation
    assert settled_when_timed and settled_when_timed[0], settled_when_timed
    assert report.timings == {"g0.forward": (4.0, 1.0)}


@pytest.mark.parametrize("mode, kept", [(CudaGraphMode.AUTO, False), (CudaGraphMode.ON, True)])
def test_a_replay_no_faster_than_eager_goes_back_to_eager_under_auto_only(mode, kept):
    """A large graph: the GPU sets the pace, and copying the saved activations in and out is pure cost
    (an 8-layer dim-2048 Llama on an H200, 2026-11-27: 0.80x Inductor's step replayed)."""
    fn, calls = counted(lambda x: (x * 2,))
    run, graphs, report = runner(fn, FakeGraphs(eager_ms=30.0, replay_ms=33.0), mode=mode)
    outs = [run(torch.full((2,), float(i)))[0] for i in range(WARMUP_CALLS + 4)]
    for i, out in enumerate(outs):  # the measured replay's outputs and the eager calls' are the same values
        torch.testing.assert_close(out, torch.full((2,), 2.0 * i), rtol=0, atol=0)
    assert report.timings == {"g0.forward": (30.0, 33.0)}
    if kept:
        assert report.captured == {"g0.forward": 1} and graphs.replays == 4 and not report.declined
    else:
        assert report.captured == {} and graphs.replays == 2 and not run.captures
        assert report.declined["g0.forward"].startswith("a replay took 33.00 ms against 30.00 ms eager")
        # the warm-up calls, the capture's two, the fake's two replays, then eager from the next call on
        assert len(calls) == WARMUP_CALLS + 2 + 2 + 2
        assert "without (g0.forward: a replay took" in report.line()


def test_parameters_are_used_in_place_and_a_moved_parameter_is_captured_again():
    w1, w2 = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    run, graphs, report = runner(lambda w, x: (x @ w,), warmup_calls=0)
    x = torch.randn(2, 4)
    torch.testing.assert_close(run(w1, x)[0], x @ w1, rtol=0, atol=0)
    cap = next(iter(run.captures.values()))
    assert cap.buffers[0] is None and cap.buffers[1] is not None  # the parameter is not copied
    with torch.no_grad():
        w1.mul_(2)  # an optimizer step: in place, same address, no new capture
    torch.testing.assert_close(run(w1, x)[0], x @ w1, rtol=0, atol=0)
    assert graphs.captures == 1
    torch.testing.assert_close(run(w2, x)[0], x @ w2, rtol=0, atol=0)  # the next block's parameters
    assert graphs.captures == 2 and report.captured == {"g0.forward": 2}


def test_a_new_shape_is_captured_again():
    run, graphs, _ = runner(lambda x: (x * 3,), warmup_calls=0)
    run(torch.ones(2))
    out = run(torch.ones(5))
    assert graphs.captures == 2 and out[0].shape == (5,)
    run(torch.ones(2))
    assert graphs.captures == 2  # the first capture is still there


def test_a_failed_capture_runs_eagerly_from_then_on_with_the_reason():
    fn, calls = counted(lambda x: (x + 1,))
    run, graphs, report = runner(fn, FakeGraphs(fail="operation not permitted when stream is capturing"),
                                 warmup_calls=0)
    out = run(torch.ones(2))
    torch.testing.assert_close(out[0], torch.full((2,), 2.0))
    assert report.declined["g0.forward"].startswith("capture failed: RuntimeError: operation not permitted")
    run(torch.ones(2))
    assert len(calls) == 2 and graphs.replays == 0


def test_too_many_kinds_of_call_give_up_with_the_reason():
    run, graphs, report = runner(lambda x: (x + 1,), warmup_calls=0, max_captures=2)
    for n in (1, 2, 3):
        torch.testing.assert_close(run(torch.ones(n))[0], torch.full((n,), 2.0))
    assert graphs.captures == 2 and "more than 2 kinds of call" in report.declined["g0.forward"]
    assert not run.captures


def test_an_output_that_views_an_input_views_the_callers_tensor():
    w = nn.Parameter(torch.randn(3, 2))
    run, graphs, report = runner(lambda x, w: (x.view(-1)[1:], w.t(), x * 2), warmup_calls=0)
    for _ in range(2):
        x = torch.randn(2, 2)
        flat, wt, doubled = run(x, w)
        assert flat.data_ptr() == x.data_ptr() + x.element_size() and flat.shape == (3,)  # x's own memory
        assert wt.data_ptr() == w.data_ptr() and wt.shape == (2, 3)
        torch.testing.assert_close(doubled, x * 2, rtol=0, atol=0)
    assert graphs.captures == 1 and graphs.replays == 2 and not report.declined


def test_a_replayed_output_keeps_the_strides_the_graph_gave_it():
    """A graph's output may be a column slice of a larger result (a forward's saved activation, say);
    the graph that takes it next was compiled for those strides. The copy out of the static output
    keeps them: a plain clone() of a non-dense tensor comes back contiguous."""
    run, graphs, report = runner(lambda x: ((x * 2)[:, :3], x.t() + 1), warmup_calls=0)
    for _ in range(2):
        x = torch.randn(4, 5)
        sliced, transposed = run(x)
        assert sliced.stride() == (5, 1) and transposed.stride() == (x.t() + 1).stride() == (1, 5)
        torch.testing.assert_close(sliced, (x * 2)[:, :3], rtol=0, atol=0)
        torch.testing.assert_close(transposed, x.t() + 1, rtol=0, atol=0)
    assert graphs.captures == 1 and graphs.replays == 2


def test_an_expanded_input_is_not_captured():
    run, graphs, report = runner(lambda x: (x * 2,), warmup_calls=0)
    x = torch.randn(1, 4).expand(3, 4)
    torch.testing.assert_close(run(x)[0], x * 2)
    assert graphs.captures == 0 and "an input is expanded" in report.declined["g0.forward"]


# -- through the backend ----------------------------------------------------------------------------

def _compile_mlp(record_graphs: CudaGraphsReport):
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.compile.passes.base import resolve_passes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("none"), executors=["aten"]))
    backend.record.cuda_graphs = record_graphs
    return model, torch.compile(model, backend=backend), backend.record


def test_the_backend_says_why_a_cpu_graph_runs_without():
    _, compiled, record = _compile_mlp(CudaGraphsReport(CudaGraphMode.ON, ON))
    compiled(torch.randn(4, 8)).sum().backward()
    assert record.cuda_graphs.declined == {"g0.forward": "the graph takes CPU tensors",
                                           "g0.backward": "the graph takes CPU tensors"}
    assert "CUDA graphs: 0 graph(s), 0 capture(s), 2 without" in record.compiled_line()
    assert any("compile.cuda_graphs = on, but 2 graph(s) run without: g0.forward: the graph takes CPU" in w
               for w in record.warnings())
    assert record.summary()["cuda_graphs"]["row"].startswith("CUDA graphs: 0 graph(s)")


def test_forward_and_backward_replay_through_the_backend_at_eager_values(monkeypatch):
    """The backend's forward and backward graphs go through the runner (a fake CUDA graph standing in):
    the saved activations and the gradients travel through static buffers, and the losses and
    gradients of five steps equal eager's."""
    from accelrun.compile import cuda_graphs

    fake = FakeGraphs()
    monkeypatch.setattr(cuda_graphs, "decide_for_graph", lambda run, facts: ON)  # CPU tensors accepted
    monkeypatch.setattr(cuda_graphs, "shared_capture", lambda report: fake)
    model, compiled, record = _compile_mlp(CudaGraphsReport(CudaGraphMode.AUTO, ON))
    eager = copy.deepcopy(model)
    for _ in range(5):
        x = torch.randn(4, 8)
        got, want = compiled(x).square().mean(), eager(x).square().mean()
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
            with torch.no_grad():  # an SGD step in place: the parameters keep their addresses
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
            p.grad = q.grad = None
    assert record.cuda_graphs.captured == {"g0.forward": 1, "g0.backward": 1}, record.cuda_graphs
    # the steps after the warm-up ones, forward and backward each
    assert fake.captures == 2 and fake.replays == 2 * (5 - WARMUP_CALLS)
    assert record.cuda_graphs.timings == {"g0.forward": (4.0, 1.0), "g0.backward": (4.0, 1.0)}
    assert "CUDA graphs: 2 graph(s), 2 capture(s)" in record.compiled_line()


def test_the_run_s_decision_reaches_the_record_before_any_graph_compiles():
    """dist.layout decides for the run (device, ranks, data) and leaves it in the compile record the
    backend reads when its graphs compile (at the first call)."""
    from types import SimpleNamespace

    from accelrun.compile.compile_model import Compiled
    from accelrun.compile.record import CompileRecord
    from accelrun.config import load_config
    from accelrun.dist.layout import with_cuda_graph_decision
    from tests.conftest import DEFAULT_CONFIG

    cfg = load_config(DEFAULT_CONFIG, ["compile.backend=accelrun"]).config
    for device, ranks, use, words in (("cuda", 1, True, "CUDA, one rank"), ("cuda", 2, False, "2 ranks"),
                                      ("cpu", 1, False, "the run is on cpu")):  # fmt: skip
        compiled = Compiled("blocks", CompileRecord())
        ctx = SimpleNamespace(device=torch.device(device), world_size=ranks)
        assert with_cuda_graph_decision(compiled, cfg, ctx) is compiled
        graphs = compiled.record.cuda_graphs
        assert graphs.mode is CudaGraphMode.AUTO and graphs.run.use is use and words in graphs.run.reason
    eager = Compiled("nothing (eager)")
    assert with_cuda_graph_decision(eager, cfg, SimpleNamespace(device=torch.device("cuda"), world_size=1)) is eager

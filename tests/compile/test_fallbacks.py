"""The compiler never takes a run down, and never claims coverage it did not have.

A pass that raises is skipped for that graph; an executor whose claim, compile or first call raises
(or returns outputs unlike the graph's nodes) hands the region to the next one, ending at aten. Each
fallback is in the record with its reason, and ``strict`` makes it an error. Frames Dynamo skips are
reported as such. Numerics against eager: fp32 rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.coverage import coverage_lines
from accelrun.compile.executors.base import Executor, register_executor
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import PassOptions, PassResult, register_pass, resolve_passes
from accelrun.compile.regions import Region


def _model_fn(x, w):
    h = torch.tanh(x @ w) * 2.0 + 1.0
    return (h.exp() * h).sum(-1)


def _compile_and_check(backend: AccelrunBackend, fn=_model_fn, grad_rtol=1e-5, grad_atol=1e-6) -> None:
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_()
    out = torch.compile(fn, backend=backend)(x, w)
    out.sum().backward()
    ref = fn(x, w_ref)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=grad_rtol, atol=grad_atol)


@register_pass("test_breaks_half_way", "post_grad")
def _breaks_half_way(gm: fx.GraphModule, options: PassOptions, ctx) -> PassResult:
    """Rewrites the graph in place, then raises: what the backend goes on with must be the graph before."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.tanh.default:
            node.target = torch.ops.aten.sigmoid.default  # wrong on purpose
    raise ValueError("a bug in a pass")


def _backend(tmp_path, passes=None, executors=("cpp", "aten"), strict=False) -> AccelrunBackend:
    passes = passes or ["dce", "test_breaks_half_way", "cse", "partition_regions"]
    return AccelrunBackend(CompileOptions(passes=resolve_passes(passes), executors=list(executors),
                                          cache_dir=tmp_path / "cache", strict=strict))  # fmt: skip


def test_a_pass_that_raises_is_skipped_for_that_graph(tmp_path):
    backend = _backend(tmp_path)
    _compile_and_check(backend)  # the half-done rewrite (tanh → sigmoid) would fail this
    record = backend.record
    assert {(f.stage, f.what) for f in record.fallbacks} == {("pass", "test_breaks_half_way")}
    assert all("ValueError: a bug in a pass" in f.reason for f in record.fallbacks)
    failed = [p for p in record.passes if p.name == "test_breaks_half_way"]
    assert failed and all(p.summary.startswith("FAILED") for p in failed)
    assert record.regions_per_executor().get("cpp")  # the passes after it still ran
    assert any("fell back" in w for w in record.summary()["warnings"])


_marks_seen: list[object] = []


@register_pass("test_marks_nodes", "post_grad")
def _marks_nodes(gm: fx.GraphModule, options: PassOptions, ctx) -> PassResult:
    for node in gm.graph.nodes:
        node.meta["test_mark"] = True
    _marks_seen.append("marked")
    return PassResult(changed=False, summary="marked every node")


@register_pass("test_reads_marks", "post_grad")
def _reads_marks(gm: fx.GraphModule, options: PassOptions, ctx) -> PassResult:
    _marks_seen.append(all(n.meta.get("test_mark") for n in gm.graph.nodes))
    return PassResult(changed=False, summary="read the marks")


def test_the_passes_before_a_failing_one_still_apply_once_recorded(tmp_path):
    # Undoing the failed pass goes back to the stage's input and runs the passes before it again.
    _marks_seen.clear()
    backend = _backend(tmp_path, passes=["test_marks_nodes", "test_breaks_half_way", "test_reads_marks",
                                         "partition_regions"])  # fmt: skip
    _compile_and_check(backend)
    reads = [seen for seen in _marks_seen if seen != "marked"]
    assert reads and all(seen is True for seen in reads), _marks_seen  # one per graph: forward, backward
    marked = [p for p in backend.record.passes if p.name == "test_marks_nodes"]
    assert len(marked) == len(reads)  # the rerun is not recorded as a second pass
    assert {f.what for f in backend.record.fallbacks} == {"test_breaks_half_way"}


_calls = {"n": 0}


@register_pass("test_succeeds_once", "post_grad")
def _succeeds_once(gm: fx.GraphModule, options: PassOptions, ctx) -> PassResult:
    _calls["n"] += 1
    if _calls["n"] > 1:
        raise RuntimeError("not the same the second time")
    return PassResult(changed=False, summary="fine the first time")


def test_a_pass_that_fails_when_run_again_sends_the_stage_input_on(tmp_path):
    _calls["n"] = 0
    backend = _backend(tmp_path, passes=["test_succeeds_once", "test_breaks_half_way", "partition_regions"])
    _compile_and_check(backend, grad_rtol=1e-4, grad_atol=1e-5)  # unfused: ATen's decomposed forms
    whats = [f.what for f in backend.record.fallbacks]
    assert whats[:2] == ["test_breaks_half_way", "post_grad passes (none changed it)"], whats
    assert "not deterministic" in backend.record.fallbacks[1].reason


def test_strict_makes_a_failing_pass_an_error(tmp_path):
    with pytest.raises(Exception, match="compile.strict"):
        _compile_and_check(_backend(tmp_path, strict=True))


class _NotPython:
    """A constant whose repr is not Python: a graph holding it lints, but its code cannot be generated."""

    def __repr__(self) -> str:
        return "<not python>"


@register_pass("test_unwritable", "post_grad")
def _unwritable(gm: fx.GraphModule, options: PassOptions, ctx) -> PassResult:
    """Adds a node whose argument cannot be written as Python, then returns as if all went well."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        gm.graph.call_function(print, (_NotPython(),))
    return PassResult(changed=True, summary="added an unwritable node")


def test_a_graph_whose_code_cannot_be_generated_goes_on_as_the_stage_got_it(tmp_path):
    # The driver generates a graph's code once after its stage's passes, outside any one pass's rollback:
    # a graph that lints but cannot be written as Python sends the stage's input on, the passes named.
    backend = _backend(tmp_path, passes=["dce", "test_unwritable", "cse", "partition_regions"])
    # The unfused graphs run op by op in ATen's decomposed forms (tanh's backward as 1 - y², ...): fp32
    # near, not equal to eager's fused kernels.
    _compile_and_check(backend, grad_rtol=1e-4, grad_atol=1e-5)
    fallbacks = backend.record.fallbacks
    assert {(f.graph, f.stage, f.what) for f in fallbacks} >= {
        ("g0.forward", "pass", "post_grad passes (test_unwritable, partition_regions)")}, fallbacks
    assert all("cannot be generated as Python" in f.reason and "SyntaxError" in f.reason for f in fallbacks)
    with pytest.raises(Exception, match="compile.strict"):
        _compile_and_check(_backend(tmp_path, passes=["test_unwritable"], strict=True))


class _Broken(Executor):
    """Claims every region; what breaks is set per subclass."""

    parallel_compile = False

    def decline_reason(self, region: Region) -> str | None:
        return None

    def compile(self, region: Region, cache_dir: str | None):
        gm = region.gm

        def run(*args):
            return tuple(gm(*args))

        return run


@register_executor
class _RaisesAtFirstCall(_Broken):
    name = "test_raises_at_first_call"

    def compile(self, region, cache_dir):
        def run(*args):
            raise RuntimeError("kernel crashed")

        return run


@register_executor
class _WrongStrides(_Broken):
    name = "test_wrong_strides"

    def compile(self, region, cache_dir):
        gm = region.gm

        def run(*args):  # right values, transposed layout (what a contiguous-only kernel once did)
            return tuple(o.t().contiguous().t() if o.dim() == 2 and o.shape[0] > 1 and o.shape[1] > 1 else o
                         for o in gm(*args))  # fmt: skip

        return run


@register_executor
class _RaisesInCompile(_Broken):
    name = "test_raises_in_compile"

    def compile(self, region, cache_dir):
        raise OSError("g++: internal compiler error")


@register_executor
class _RaisesInClaim(_Broken):
    name = "test_raises_in_claim"

    def decline_reason(self, region):
        raise KeyError("a bug in deciding")


@pytest.mark.parametrize(("broken", "stage", "reason"), [
    ("test_raises_at_first_call", "first call", "kernel crashed"),
    ("test_wrong_strides", "first call", "strides"),
    ("test_raises_in_compile", "compile", "internal compiler error"),
    ("test_raises_in_claim", "claim", "a bug in deciding"),
])  # fmt: skip
def test_a_failing_executor_hands_the_region_on(tmp_path, broken, stage, reason):
    backend = _backend(tmp_path, passes="default", executors=(broken, "cpp", "aten"))
    _compile_and_check(backend)
    record = backend.record
    assert record.regions, "the case needs fusion regions"
    mine = [f for f in record.fallbacks if f.what.startswith("region") and broken in f.what]
    assert mine and all(f.stage == stage and reason in f.reason for f in mine)
    assert all(r.executor == "cpp" for r in record.regions)  # the next executor took every region
    assert all(broken in r.declined for r in record.regions)


def test_strict_makes_a_failing_kernel_an_error(tmp_path):
    with pytest.raises(Exception, match="compile.strict"):
        _compile_and_check(_backend(tmp_path, passes="default", executors=("test_raises_at_first_call", "aten"),
                                    strict=True))  # fmt: skip


def _skipped_everywhere(x):
    for _ in range(2):
        if x.sum() > 0:  # a data-dependent branch inside a loop: Dynamo skips the whole frame
            x = x * 0.5
        else:
            x = x + 1.0
    return x


def test_a_frame_dynamo_skips_is_reported_not_counted_as_compiled(tmp_path):
    backend = _backend(tmp_path, passes="default")
    x = torch.randn(4, 4)
    torch.testing.assert_close(torch.compile(_skipped_everywhere, backend=backend)(x), _skipped_everywhere(x))
    summary = backend.record.summary()
    assert summary["dynamo_graphs"] == 0
    assert summary["dynamo"]["frames_skipped"] and "_skipped_everywhere" in summary["dynamo"]["frames_skipped"][0]
    assert any(w.startswith("nothing was compiled") for w in summary["warnings"])
    assert any("Dynamo skipped a frame" in line for line in coverage_lines(backend.record))
    from accelrun.report.markdown import _compiler_section

    report = "\n".join(_compiler_section(summary))
    assert "**warning**: nothing was compiled" in report and "| 1 / 0 / 1 |" in report


def test_a_routed_layer_loop_reports_the_skipped_frame_and_the_layers_compiled(tmp_path):
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.gate = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            return x + torch.tanh(self.lin(x)) * 2.0

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

        def forward(self, x):
            for layer in self.layers:
                if layer.gate(x).mean() > 0:  # a routed MoE's data-dependent branch
                    x = layer(x)
            return x

    torch.manual_seed(0)
    model, backend = Routed(), _backend(tmp_path, passes="default")
    x = torch.randn(4, 8)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x), rtol=1e-5, atol=1e-6)
    d = backend.record.summary()["dynamo"]
    assert d["frames_seen"] > d["frames_compiled"]
    assert any("forward" in s for s in d["frames_skipped"])
    assert any("Data-dependent branching" in why and "test_fallbacks.py:" in why for why in d["unsupported"])


class _Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * 2.0 + 1.0


class _RoutedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([_Expert(), _Expert()])  # deeper: not what scope=block takes
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, expert: int):
        return x + self.experts[expert](self.norm(x))


class _RoutedModel(torch.nn.Module):
    """A user's model with its blocks under another name than `layers` and a data-dependent router."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_RoutedBlock(), _RoutedBlock()])
        self.router = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x, 0 if self.router(x).mean() > 0 else 1)
        return x


def test_scope_block_compiles_a_custom_models_repeated_blocks_not_its_router(tmp_path):
    from accelrun.compile.compile_model import compile_model, repeated_blocks
    from accelrun.config.schema import CompileConfig

    torch.manual_seed(0)
    model = _RoutedModel()
    reference = __import__("copy").deepcopy(model)
    assert repeated_blocks(model) == ("blocks", list(model.blocks))
    cfg = CompileConfig(backend="accelrun", scope="block", executors=["cpp", "aten"], graph_cache=False,
                        cache_dir=str(tmp_path / "cache"))  # fmt: skip
    compiled = compile_model(model, None, cfg)
    assert "2 repeated _RoutedBlock blocks (blocks)" in compiled.description
    x = torch.randn(4, 8)
    out, ref = model(x), reference(x)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    summary = compiled.record.summary()
    assert summary["dynamo_graphs"] >= 1 and not summary["dynamo"]["frames_skipped"]
    assert not any(w.startswith("nothing was compiled") for w in summary["warnings"])
    assert compiled.record.regions_per_executor().get("cpp", 0) > 0


def test_the_backend_by_name_with_torch_compile_options(tmp_path):
    """What the ``torch_dynamo_backends`` entry point ("accelrun") registers; here under a test name."""
    from accelrun.compile.backend import dynamo_backend

    name = "accelrun_by_name_test"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(compiler_fn=dynamo_backend, name=name)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    opts = {"passes": "default", "executors": ["cpp", "aten"], "strict": True, "cache_dir": str(tmp_path)}
    torch.testing.assert_close(torch.compile(_model_fn, backend=name, options=opts)(x, w), _model_fn(x, w),
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown option"):
        torch.compile(_model_fn, backend=name, options={"pases": "max"})(x, w)


def _two_regions_per_graph(x, w):
    h = torch.tanh(x @ w) * 2.0  # a region, a matmul, another region: two regions in each graph
    return ((h @ w * 0.1).exp() * h).sum(-1)


def _cpp_regions(backend: AccelrunBackend) -> dict[str, int]:
    """Regions per graph of ``_two_regions_per_graph`` compiled at eager's numerics, all by ``cpp``."""
    _compile_and_check(backend, _two_regions_per_graph)
    assert not backend.record.fallbacks
    graphs: dict[str, int] = {}
    for row in backend.record.regions:
        assert row.executor == "cpp"
        graphs[row.graph] = graphs.get(row.graph, 0) + 1
    return graphs


def test_a_graphs_cpp_regions_build_as_one_library(tmp_path):
    from accelrun.compile.codegen import cpp_build

    before = cpp_build.compiler_invocations()
    graphs = _cpp_regions(_backend(tmp_path, passes="default"))
    assert len(graphs) == 2 and all(n >= 2 for n in graphs.values()), graphs  # forward and backward, 2+ each
    assert cpp_build.compiler_invocations() - before == len(graphs)  # one g++ run per graph, not per region


def test_a_backward_graph_s_library_builds_at_a_lower_cpu_priority(tmp_path, monkeypatch):
    """The backward's regions first run after the whole forward: their g++ yields the cores to the step
    and to the forward's build (``nice``), which is what a cold first step waits for."""
    import os
    import shutil

    from accelrun.compile.codegen import cpp_build

    log = tmp_path / "niceness.log"
    wrapper = tmp_path / "cxx"
    # Logs the niceness each build ran at, next to whether its source holds a backward graph's code.
    wrapper.write_text(f"""#!/bin/sh
case "$*" in *-shared*) echo "$(nice)" >> {log} ;; esac
exec {shutil.which("g++")} "$@"
""")
    wrapper.chmod(0o755)
    monkeypatch.setenv("ACCELRUN_CXX", str(wrapper))
    graphs = _cpp_regions(_backend(tmp_path, passes="default"))
    assert len(graphs) == 2, graphs  # forward and backward: one library each
    base = os.nice(0)
    niceness = sorted(int(line) for line in log.read_text().split())
    assert niceness == [base, min(base + cpp_build.LATER_NICENESS, 19)], niceness


def test_a_batch_g_plus_plus_refuses_is_built_region_by_region(tmp_path, monkeypatch):
    """One region g++ cannot take must not cost the graph's other regions: the lowering builds them alone."""
    from accelrun.compile.codegen import cpp_build
    from accelrun.compile.executors.cpp import CppExecutor

    def refused(self, regions, cache_dir):
        raise RuntimeError("g++ failed on generated code")

    monkeypatch.setattr(CppExecutor, "compile_batch", refused)
    before = cpp_build.compiler_invocations()
    graphs = _cpp_regions(_backend(tmp_path, passes="default"))
    assert cpp_build.compiler_invocations() - before == sum(graphs.values())


def test_the_lowering_does_not_wait_for_g_plus_plus_the_first_call_does(tmp_path, monkeypatch):
    """Builds run beside what follows the lowering (the backward's tracing, the forward's first ops): a
    build still running when the graph is placed is waited for at its region's first call, and its
    compile time and cache use reach the record then."""
    import threading

    from accelrun.compile import lower
    from accelrun.compile.executors.cpp import CppExecutor

    release, placed_before_release = threading.Event(), []
    build, outcome = CppExecutor.compile_batch, lower.PendingBuild.outcome

    def held_build(self, regions, cache_dir):
        assert release.wait(60)
        return build(self, regions, cache_dir)

    def first_call_waits(self):  # the first region call: what the lowering had placed by now
        if not release.is_set():
            placed_before_release.extend(r.graph for r in backend.record.regions)
            release.set()
        return outcome(self)

    monkeypatch.setattr(CppExecutor, "compile_batch", held_build)
    monkeypatch.setattr(lower.PendingBuild, "outcome", first_call_waits)
    backend = _backend(tmp_path, passes="default")
    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    out = torch.compile(_two_regions_per_graph, backend=backend)(x, w)
    # The forward's regions were placed in the graph while their build was held: lowering did not wait.
    assert placed_before_release and any(g.endswith("forward") for g in placed_before_release)
    assert all(r.cache_hit is False and r.compile_s > 0 for r in backend.record.regions if r.graph.endswith("forward"))
    out.sum().backward()
    torch.testing.assert_close(out, _two_regions_per_graph(x, w.detach()), rtol=1e-5, atol=1e-6)
    assert all(r.executor == "cpp" and r.cache_hit is False for r in backend.record.regions)
    assert backend.record.cache_misses == len(backend.record.regions)


def test_the_build_threads_run_what_they_built_on_one_openmp_thread(monkeypatch):
    """A build thread runs the region it built once (the check at short lengths). On torch's thread
    count that starts an OpenMP team living as long as the pool, and libgomp, managing more threads
    than cores, then wakes the training thread's team at each parallel region instead of letting it
    spin: a 20 us kernel took 45-60 us. Each build thread takes one thread; a thread started after
    them (a user's, torch's) still starts with torch's count, not with the build threads' 1."""
    import os
    import threading

    from accelrun.compile import lower

    before = torch.get_num_threads()
    monkeypatch.setattr(lower, "_pool", None)  # a new pool: its threads read the count set here
    torch.set_num_threads(2)
    try:
        pool = lower._build_pool()
        jobs = min(2, os.cpu_count() or 1)  # at once: as many build threads started
        started = threading.Barrier(jobs)

        def count_when_all_run() -> int:
            started.wait(30)
            return torch.get_num_threads()

        counts = {f.result() for f in [pool.submit(count_when_all_run) for _ in range(jobs)]}
        pool.shutdown()
        assert counts == {1}
        later: list[int] = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [2]
    finally:
        torch.set_num_threads(before)


def test_a_batch_pickles_before_it_is_built_as_it_will_once_built(tmp_path):
    """The graph cache saves a graph whose builds may still be running: each region's saved form (its
    library's path, known from the source's hash) is what the built region pickles as. Identical
    regions share one entry of the library."""
    from accelrun.compile.executors.cpp import CppExecutor
    from tests.compile.traced_regions import regions_of

    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    regions = regions_of(_two_regions_per_graph, x, w)
    twice = regions + regions_of(_two_regions_per_graph, x, w)  # a repeated layer's regions
    executor, cache = CppExecutor(), str(tmp_path / "cpp")
    assert all(executor.decline_reason(r) is None for r in twice)
    forms = executor.saved_forms(twice, cache)
    built = executor.compile_batch(twice, cache)
    assert [fn.__reduce__() for fn in built] == forms
    entries = [fn.entry for fn in built]
    assert entries[: len(regions)] == entries[len(regions):] and len(set(entries)) == len(regions)


def test_a_pending_build_that_fails_hands_its_regions_on_at_the_first_call(tmp_path, monkeypatch):
    from accelrun.compile.executors.cpp import CppExecutor

    def refused(self, *args):
        raise RuntimeError("g++ failed on generated code")

    monkeypatch.setattr(CppExecutor, "compile_batch", refused)
    monkeypatch.setattr(CppExecutor, "compile", refused)
    backend = _backend(tmp_path, passes="default")
    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    out = torch.compile(_two_regions_per_graph, backend=backend)(x, w)
    out.sum().backward()
    torch.testing.assert_close(out, _two_regions_per_graph(x, w.detach()), rtol=1e-5, atol=1e-6)
    record = backend.record
    assert record.regions and all(r.executor == "aten" and "cpp" in r.declined for r in record.regions)
    assert all(f.stage == "compile" and "g++ failed" in f.reason for f in record.fallbacks)
    assert len(record.fallbacks) == len(record.regions)


def test_blocks_past_dynamos_recompile_limit_are_a_warning(tmp_path):
    """Blocks whose code branches on a per-instance attribute compile once each; past Dynamo's
    recompile limit the rest run eagerly. The record said "8 graphs" and nothing else (transformers'
    Llama did this with its KV cache on: accelrun now trains it with use_cache=False)."""

    class Block(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i, self.lin = i, torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * 2 if self.i % 2 else self.lin(x) + self.i

    torch._dynamo.reset()
    backend = _backend(tmp_path, passes="default")
    blocks = [Block(i) for i in range(10)]
    for b in blocks:
        b.compile(backend=backend)
    x = torch.randn(2, 4)
    for b in blocks:
        x = b(x)
    warnings = backend.record.summary()["warnings"]
    assert any(w.startswith("Dynamo hit its recompile limit ×") for w in warnings), warnings
    assert backend.record.dynamo_graphs == torch._dynamo.config.recompile_limit
    torch._dynamo.reset()


def _changing_sizes(compiled, reference, features: int, sizes=(40, 52, 61, 77, 83, 90, 97, 101, 113, 127, 131)):
    """Calls with a different number of rows each time, forward and backward against eager."""
    for rows in sizes:
        x = torch.randn(rows, features, requires_grad=True)
        out, ref = compiled(x), reference(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        (got,) = torch.autograd.grad(out.square().sum(), x)
        (want,) = torch.autograd.grad(ref.square().sum(), x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_size_that_changes_between_calls_compiles_once_more_not_once_per_size(tmp_path):
    """An expert of a mixture meets a different number of tokens every call. Dynamo compiles the first
    size, then the dimension as a symbol; the C++ generator read that symbol as a number, which made
    Dynamo guard on its value: a graph per token count, and past the recompile limit (8) the expert ran
    eagerly (a walk's hand-written mixture: 10 graphs and the limit's warning in 25 steps). The symbol
    is only the rows the kernels loop over (the SiLU, its backward and the bias's gradient), so the
    graph for any size keeps its C++ kernels, which read the row count at each call (until 2026-12-05
    they stayed ATen calls there, the decomposed SiLU slower than eager's own)."""
    torch._dynamo.reset()
    backend = _backend(tmp_path, passes="default")
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))
    _changing_sizes(torch.compile(expert, backend=backend), expert, 16, sizes=(40, 52, 61, 77, 83, 90, 97, 101, 113,
                                                                             127, 131, 2, 3))  # fmt: skip
    record = backend.record
    # the first size, then one graph for any size (2 and 3 included: Dynamo specializes 0 and 1 only)
    assert record.dynamo_graphs == 2, record.compiled_line()
    assert not any("recompile limit" in w for w in record.summary()["warnings"])
    assert all(r.executor == "cpp" for r in record.regions), record.regions_left_to_aten()
    rows = [r for r in record.regions if r.runtime_rows]
    assert len(rows) == 2 and {r.graph for r in rows} == {"g1.forward", "g1.backward"}, record.regions
    assert record.summary()["regions_with_runtime_rows"] == 2
    torch._dynamo.reset()


def test_a_changing_size_past_the_rows_is_read_as_a_number_twice_then_left_to_aten(tmp_path):
    """Where the changing size is not only the rows a kernel loops over, nor a whole multiple of it
    in each size (here a mean over the rows: the kernel would divide by it), the kernels are written
    for fixed sizes: a frame's first two compiles read it as a number (a size that changed once keeps
    its kernels), and from the third the region stays in ATen with the reason, so that one graph
    serves every further size. (A transposed tensor was the example until kernels read a length
    past the rows at each call, codegen.linear_sizes.)"""
    from accelrun.compile.executors.generated import SPECIALIZING_COMPILES, SYMBOLIC_SIZES

    torch._dynamo.reset()
    backend = _backend(tmp_path, passes="default")

    def centred(x):
        return torch.tanh(x - x.mean(0, keepdim=True)) + 1.0

    _changing_sizes(torch.compile(centred, backend=backend), centred, 8)
    record = backend.record
    assert record.dynamo_graphs == SPECIALIZING_COMPILES + 1 == 3, record.compiled_line()
    assert not any("recompile limit" in w for w in record.summary()["warnings"])
    assert sum(r.executor == "cpp" for r in record.regions) >= 2  # the fixed sizes: generated code
    symbolic = [r for r in record.regions if r.declined.get("cpp", "").startswith(SYMBOLIC_SIZES)]
    assert symbolic and all(r.executor == "aten" and not r.runtime_rows for r in symbolic)
    assert "nor as a·s + b in every size" in symbolic[0].declined["cpp"], symbolic[0].declined
    torch._dynamo.reset()


def test_the_backend_by_name_compiles_a_changing_size_three_times_not_once_per_size(tmp_path):
    """A new user's `torch.compile(model, backend="accelrun")` over 11 lengths: 8 graphs, then Dynamo's
    recompile limit and eager for the rest. The named backend made an AccelrunBackend for every graph, so
    no frame's compiles were counted and no graph for any size was ever asked for."""
    from torch._dynamo.utils import counters

    from accelrun.compile.backend import dynamo_backend

    name = "accelrun_by_name_test"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(compiler_fn=dynamo_backend, name=name)
    torch._dynamo.reset()
    counters.clear()

    def centred(x):
        return torch.tanh(x - x.mean(0, keepdim=True)) + 1.0

    compiled = torch.compile(centred, backend=name, options={"executors": ["cpp", "aten"], "cache_dir": str(tmp_path)})
    _changing_sizes(compiled, centred, 8)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    torch._dynamo.reset()


def test_a_size_read_from_the_data_runs_in_kernels_that_read_it_at_each_call(tmp_path):
    """The rows a boolean mask picks have a size Dynamo knows only at run time (an unbacked symbol).
    The C++ generator read it as a number, which raises "could not guard on data-dependent expression":
    a fallback warning for every such region (a walk's mixture of experts: 12 per run); then such
    regions were declined. They are the rows the kernel loops over, so it reads their count at each
    call: every row picked, some, one, none."""
    torch._dynamo.reset()
    backend = _backend(tmp_path, passes="default")

    from tests.compile.user_models import mask_choices, rows_picked_by_a_mask

    torch.manual_seed(0)
    w = torch.randn(8, 8)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(rows_picked_by_a_mask, backend=backend, fullgraph=True)
        for chosen in mask_choices(torch.randn(32, 8)):
            torch.testing.assert_close(compiled(chosen, w), rows_picked_by_a_mask(chosen, w), rtol=1e-5, atol=1e-6)
    record = backend.record
    assert not record.fallbacks, record.fallbacks
    assert record.dynamo_graphs == 1, record.compiled_line()
    assert [r.executor for r in record.regions if r.runtime_rows] == ["cpp"], record.regions
    torch._dynamo.reset()


def test_a_size_read_from_the_data_past_the_rows_is_declined_with_its_reason(tmp_path):
    """Where rows a mask picked are then transposed, the kernels would need the count as a stride:
    the region is declined with that reason (reading it as a number would raise), and the graph runs
    at eager's results."""
    from accelrun.compile.executors.generated import DATA_DEPENDENT_SIZES

    torch._dynamo.reset()
    backend = _backend(tmp_path, passes="default")

    def picked(x, w):
        chosen = (x[x.sum(-1) > 0] @ w).t()
        return torch.tanh(chosen * 2.0).sum(0) + 1

    x, w = torch.randn(32, 8), torch.randn(8, 8)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(picked, backend=backend, fullgraph=True)(x, w)
    torch.testing.assert_close(got, picked(x, w), rtol=1e-5, atol=1e-6)
    record = backend.record
    assert not record.fallbacks, record.fallbacks
    declined = [r for r in record.regions if r.declined.get("cpp", "").startswith(DATA_DEPENDENT_SIZES)]
    assert declined and all(r.executor == "aten" for r in declined), record.regions
    torch._dynamo.reset()


def test_the_backend_by_name_counts_a_frame_afresh_after_dynamo_is_reset(tmp_path):
    """``torch._dynamo.reset()`` numbers frames from 0 again, but the named backend (one per set of
    options for the process) kept its count of each frame id's compiles: a model compiled after a reset
    took its frame's compiles as those of whichever frame had that id before, and its graph for any size
    kept its regions in ATen as if its sizes kept changing."""
    from accelrun.compile import backend as backend_module

    name = "accelrun_by_name_test"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(compiler_fn=backend_module.dynamo_backend, name=name)
    opts = {"executors": ["cpp", "aten"], "cache_dir": str(tmp_path / "reset")}

    def centred(x):
        return torch.tanh(x - x.mean(0, keepdim=True)) + 1.0

    cpp_regions = []
    for _ in range(2):
        torch._dynamo.reset()
        _changing_sizes(torch.compile(centred, backend=name, options=opts), centred, 8, sizes=(40, 52, 61))
        record = backend_module._NAMED_BACKENDS[repr(sorted(opts.items()))].record
        cpp_regions.append(sum(r.executor == "cpp" for r in record.regions))
    torch._dynamo.reset()
    assert cpp_regions[0] > 0
    assert cpp_regions[1] == 2 * cpp_regions[0], cpp_regions  # the same graphs again, regions in C++ alike


@register_executor
class _WrongValues(_Broken):
    name = "test_wrong_values"

    def compile(self, region, cache_dir):
        gm = region.gm

        def run(*args):  # a kernel that computes something else, quietly
            return tuple(o * 1.5 if o.is_floating_point() else o for o in gm(*args))

        return run


def test_debug_numerics_compares_the_lowered_graph_with_the_graph_before_it(tmp_path):
    """A compiler engineer's trial: debug_numerics compared the passes only, never the kernels the lowering
    generates, so a wrong kernel trained on without a word under it."""
    from accelrun.compile.numerics import PassNumericsError

    def options(executors):
        return CompileOptions(passes=resolve_passes(["dce", "partition_regions"]), executors=executors,
                              cache_dir=tmp_path / "cache", debug_numerics=True)

    torch._dynamo.reset()
    backend = AccelrunBackend(options(["cpp", "aten"]))
    _compile_and_check(backend)
    said = {g.name: g.lowering_numerics for g in backend.record.graphs}
    assert said and all(v == "equal before and after" for v in said.values()), said
    assert "lowered graph(s) equal before and after" in backend.record.compiled_line()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"the lowering of g0\.forward \(its regions' generated kernels\) changed"
                                        r" the graph's results") as raised:
        _compile_and_check(AccelrunBackend(options(["test_wrong_values", "aten"])))
    assert isinstance(raised.value, PassNumericsError) or "PassNumericsError" in str(raised.value)
    torch._dynamo.reset()

"""One test per private torch / Triton symbol in ``accelrun.torch_private``: that it exists and has the
shape accelrun relies on. A torch or Triton release that moves or reshapes one fails the test named
after it (``test_<symbol>``), not a user's run. ``test_every_symbol_has_its_test`` keeps the list whole."""

from __future__ import annotations

import contextlib
import inspect
import os
import platform
import sys

import pytest
import sympy
import torch

import accelrun.torch_private as tp

EAGER = ("reinterpret_tensor", "empty_strided_cpu", "TensorGuards")
FUNCTIONS = ("on_group_restart", "agent_exit_codes", "cuda_current_raw_stream", "triton_direct_launch", "cpu_has_half_gemm", "onednn_linear",
             "import_module_globals", "files_traced_by_precompile", "unread_compile_logs_skipped",
             "drop_failed_async_compiles", "no_donated_buffers")
ATTRIBUTES = ("COMPILED_CALL",)  # names of private attributes torch's own classes keep


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_every_symbol_has_its_test():
    names = [*EAGER, *tp.PRIVATE, *FUNCTIONS, *ATTRIBUTES]
    missing = [n for n in names if f"test_{n}" not in globals()]
    assert not missing, f"add a test for each of {missing}"


def test_a_missing_symbol_is_an_import_error_that_names_it(monkeypatch):
    monkeypatch.setitem(tp.PRIVATE, "not_there", ("torch", "_accelrun_not_there"))
    with pytest.raises(ImportError, match="torch._accelrun_not_there"):
        from accelrun.torch_private import not_there  # noqa: F401


# --- torch._C members (None would only slow accelrun down; on the tested range they exist) ------------


def test_reinterpret_tensor():
    base = torch.arange(12.0)
    view = tp.reinterpret_tensor(base, [3, 2], [4, 1], 1)  # (base, sizes, strides, storage offset)
    assert torch.equal(view, base.as_strided((3, 2), (4, 1), 1))
    assert view.data_ptr() == base.data_ptr() + 4  # a view, not a copy


def test_empty_strided_cpu():
    t = tp.empty_strided_cpu((2, 3), (1, 2), torch.float32)  # (sizes, strides, dtype)
    assert t.shape == (2, 3) and t.stride() == (1, 2) and t.dtype == torch.float32 and t.device.type == "cpu"


def test_TensorGuards():
    a, b = torch.randn(2, 3), torch.randn(4)
    guard = tp.TensorGuards(a, b, dynamic_dims_sizes=[[2, 3], [4]], dynamic_dims_strides=[[3, 1], [1]])
    assert guard.check(a, b)
    assert not guard.check(a.t().contiguous().t(), b)  # other strides
    assert not guard.check(a.double(), b)


# --- AOTAutograd --------------------------------------------------------------------------------------


def test_aot_module_simplified():
    assert {"mod", "args", "fw_compiler", "bw_compiler", "inference_compiler", "partition_fn",
            "decompositions"} <= set(_params(tp.aot_module_simplified))  # fmt: skip


def test_make_boxed_func():
    boxed = tp.make_boxed_func(lambda a, b: (a + b,))
    assert boxed([1, 2]) == (3,) and getattr(boxed, "_boxed_call", False)


def test_default_partition():
    # The backend passes AOTAutograd's keyword arguments on; remat reads num_fwd_outputs from them.
    params = inspect.signature(tp.default_partition).parameters
    assert "num_fwd_outputs" in params and params["num_fwd_outputs"].kind is inspect.Parameter.KEYWORD_ONLY


def test_functorch_config():
    # The backend sets force_non_lazy_backward_lowering: AOTAutograd then compiles the backward graph
    # when it compiles the forward, before anything runs (else at the first backward).
    compiled: list[str] = []

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            compiled.append(kind)
            return tp.make_boxed_func(gm.forward)
        return compile_graph

    def f(x):
        return (x.sin() * 2,)

    gm = torch.fx.symbolic_trace(f)
    x = torch.randn(4, requires_grad=True)
    with tp.functorch_config.patch(force_non_lazy_backward_lowering=True):
        fn = tp.aot_module_simplified(gm, [x], fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))
    assert compiled == ["forward", "backward"]
    fn(x)[0].sum().backward()
    assert compiled == ["forward", "backward"] and torch.allclose(x.grad, 2 * x.detach().cos())


def test_no_donated_buffers():
    # A backward compiled with the forward, inside: retain_graph=True is refused with donations (torch's
    # default), and runs without them; the metadata the backward reads then holds none, not None.
    from torch._guards import TracingContext, tracing

    def f(x, w):
        return (torch.relu(x @ w) * 2,)

    def compile_once(donating: bool):
        gm = torch.fx.symbolic_trace(f)
        x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
        with tracing(TracingContext(None)), tp.functorch_config.patch(force_non_lazy_backward_lowering=True):
            with contextlib.nullcontext() if donating else tp.no_donated_buffers():
                fn = tp.aot_module_simplified(gm, [x, w], fw_compiler=lambda g, _: tp.make_boxed_func(g.forward))
            donated = TracingContext.try_get().fw_metadata.bw_donated_idxs
        (y,) = fn(x, w)
        return y, w, donated

    y, w, donated = compile_once(True)
    assert donated  # torch's default donates: what the refusal below comes from
    with pytest.raises(RuntimeError, match="donated buffers"):
        y.sum().backward(retain_graph=True)
    y, w, donated = compile_once(False)
    assert donated == []
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert w.grad is not None


def test_InputMutationAOTOutput():
    # AOTAutograd's forward returns a changed input's new value, described by the input's own description
    # (its placeholder's meta["desc"]), also for a change through .data, which no traced version counter sees.
    seen = {}

    def partition(joint, inputs, **kwargs):
        fw, bw = tp.default_partition(joint, inputs, **kwargs)
        seen["inputs"] = [n.meta.get("desc") for n in fw.graph.find_nodes(op="placeholder")]
        seen["outputs"] = fw.graph.output_node().meta.get("desc")
        return fw, bw

    def f(x, buf):
        y = x.sin() * buf.exp()
        buf.data.mul_(0.5)
        return (y,)

    gm = torch.fx.symbolic_trace(f)
    x, buf = torch.randn(4, requires_grad=True), torch.ones(4)
    fn = tp.aot_module_simplified(gm, [x, buf], fw_compiler=lambda g, _: tp.make_boxed_func(g.forward),
                                  partition_fn=partition)
    fn(x, buf)[0].sum().backward()
    (changed,) = [d for d in seen["outputs"] if isinstance(d, tp.InputMutationAOTOutput)]
    assert changed.mutated_input == seen["inputs"][1]


def test_SavedForBackwardsAOTOutput():
    assert tp.SavedForBackwardsAOTOutput(3).idx == 3  # remat renumbers the saved outputs' descriptors


def test_SerializableAOTDispatchCompiler():
    assert list(_params(tp.SerializableAOTDispatchCompiler.__init__))[1:] == ["output_code_ty", "compiler_fn"]


def test_BundledAOTAutogradSerializableCallable():
    # The graph cache's precompiled graph subclasses it: it takes the forward AOTAutograd returns (which
    # has .serialize) and keeps it as .compiled_fn, which its serialize_compile_artifacts calls.
    forward = lambda *args: args  # noqa: E731
    forward.serialize = lambda: b"entry"
    wrapped = tp.BundledAOTAutogradSerializableCallable(forward)
    assert wrapped.compiled_fn is forward
    for name in ("serialize_compile_artifacts", "deserialize_compile_artifacts"):
        assert callable(getattr(tp.BundledAOTAutogradSerializableCallable, name)), name


def test_core_aten_decompositions_post_autograd():
    table = tp.core_aten_decompositions_post_autograd()
    assert torch.ops.aten.silu.default in table
    # the backend drops attention's by their names
    assert any("attention" in op.name() for op in table)


class _ManyNnModules(torch.nn.Module):
    """torch.nn's own modules and functions whose CompositeImplicitAutograd ops export's table decomposes."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.emb, self.lin, self.conv = nn.Embedding(10, 16), nn.Linear(16, 16), nn.Conv1d(16, 16, 3, padding=1)
        self.ln, self.rms, self.gn = nn.LayerNorm(16), nn.RMSNorm(16), nn.GroupNorm(4, 16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x, ids, y):
        F = torch.nn.functional
        h = self.rms(self.ln(self.lin(x))) + self.emb(ids)
        h = self.gn(self.conv(h.transpose(1, 2))).transpose(1, 2)
        a, _ = self.mha(h, h, h)
        q = a.view(2, 5, 2, 8).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(2, 5, 16)
        o = F.gelu(o) * F.silu(o) + torch.softmax(o, -1) + F.interpolate(o, scale_factor=2, mode="nearest")[..., ::2]
        return F.cross_entropy(o.reshape(-1, 16), y.reshape(-1)) + o.var(-1).mean() + torch.einsum("bij,bkj->bik", o, o).mean()


def test_the_post_autograd_table_traces_the_graphs_exports_table_does():
    # The backend traces with the smaller table to save a cold start 0.2-0.3 s; that is only sound while
    # what export's table adds never reaches AOTAutograd's tracer (the dispatcher decomposes it first).
    from torch._decomp import core_aten_decompositions

    inputs = (torch.randn(2, 5, 16), torch.randint(0, 10, (2, 5)), torch.randint(0, 16, (2, 5)))
    graphs = []
    for table in (dict(core_aten_decompositions().items()), tp.core_aten_decompositions_post_autograd()):
        torch._dynamo.reset()
        codes: list[str] = []

        def keep(gm, example_inputs, codes=codes):
            codes.append(gm.code)
            return tp.make_boxed_func(gm.forward)

        def backend(gm, example_inputs, table=table, keep=keep):
            return tp.aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep, decompositions=table)

        torch.manual_seed(0)
        compiled = torch.compile(_ManyNnModules(), backend=backend, fullgraph=True)
        compiled(*inputs).backward()
        with torch.no_grad():
            compiled(*inputs)
        graphs.append(codes)
    torch._dynamo.reset()
    assert len(graphs[0]) == 3  # forward, backward, inference
    assert graphs[0] == graphs[1]
    # and the backend traces with that table (less attention's, which its own kernels take)
    from accelrun.compile.backend import decompositions

    table = tp.core_aten_decompositions_post_autograd()
    assert decompositions().keys() == {op for op in table if "attention" not in op.name()}


# --- Inductor -----------------------------------------------------------------------------------------


def test_OutputCode():
    # AccelrunOutputCode implements these; precompile calls them.
    for method in ("__call__", "post_compile", "prepare_for_serialization", "set_triton_bundle"):
        assert callable(getattr(tp.OutputCode, method, None)), method
    assert list(_params(tp.OutputCode.post_compile))[1:] == ["example_inputs", "constants", "graph_kwargs"]


def test_compile_fx_inner():
    assert list(_params(tp.compile_fx_inner))[:2] == ["gm", "example_inputs"]


def test_inductor_decompositions():
    table = tp.inductor_decompositions()
    assert torch.ops.aten._softmax.default in table and callable(table[torch.ops.aten._softmax.default])


def test_temporary_cache_dir(tmp_path):
    with tp.temporary_cache_dir(str(tmp_path)):
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(tmp_path)


# --- Dynamo -------------------------------------------------------------------------------------------


def test_AOTCompiledFunction():
    assert _params(tp.AOTCompiledFunction.deserialize)[:2] == ["data", "f_globals"]
    assert callable(tp.AOTCompiledFunction.guard_check)


def test_CheckFunctionManager():
    # graph_cache.saveable_guards starts from the kinds precompile cannot save.
    kinds = tp.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    assert {"ID_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH"} <= set(kinds)


def test_import_module_globals():
    """A frame whose Dynamo bytecode loads a module through a per-process global: the global becomes an
    import by name, and the frame loads where the global is gone (another process)."""
    import collections
    import types

    from torch._dynamo.types import GuardFilterEntry

    assert {"name", "value", "guard_type", "derived_guard_types", "is_global"} <= set(GuardFilterEntry.__annotations__)
    scope: dict = {"torch": torch}
    exec("def f(x):\n    return x + 1", scope)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(enable_aot_compile=True):
        entry = torch.compile(scope["f"], backend="eager", fullgraph=True).aot_compile(((torch.ones(2),), {}))
    env = entry._artifacts.runtime_env
    entry._extra_globals["___module_collections_1_c0"] = collections  # as Dynamo names one it installs
    entry._artifacts.runtime_env = type(env)(**{**env.__dict__, "external_refs": {*env.external_refs,
                                                                                  "___module_collections_1_c0"}})
    assert tp.import_module_globals(entry) == ["___module_collections_1_c0"]
    assert entry._artifacts.runtime_env.import_sources["___module_collections_1_c0"] == "collections"
    data = type(entry).serialize(entry).serialized_data
    loaded = tp.AOTCompiledFunction.deserialize(data, {"torch": torch})  # no such global here
    assert isinstance(loaded.fn, types.FunctionType) and loaded.fn.__globals__["___module_collections_1_c0"] is collections
    torch.testing.assert_close(loaded.fn(torch.ones(2)), torch.full((2,), 2.0))
    torch._dynamo.reset()


def test_SourceInfo():
    assert callable(tp.SourceInfo.add_code) and _params(tp.SourceInfo.add_code) == ["self", "code"]


def test_files_traced_by_precompile(tmp_path, monkeypatch):
    """Every traced function's file, the one a helper lives in included; torch's own record left empty
    inside the block, and kept again outside it (after one that raised too)."""
    (tmp_path / "traced_helper.py").write_text("import torch\ndef act(x):\n    return torch.relu(x) * 2\n")
    (tmp_path / "traced_model.py").write_text("from traced_helper import act\ndef f(x):\n    return act(x) + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import traced_model

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(enable_aot_compile=True), tp.files_traced_by_precompile() as files:
            entry = torch.compile(traced_model.f, backend="eager", fullgraph=True).aot_compile(((torch.ones(2),), {}))
        with pytest.raises(RuntimeError), tp.files_traced_by_precompile():
            raise RuntimeError("a failed precompile")
        outside = tp.SourceInfo(inlined_sources=set())
        outside.add_code(traced_model.f.__code__)
    finally:
        torch._dynamo.reset()
        for name in ("traced_model", "traced_helper"):
            sys.modules.pop(name, None)
    assert {str(tmp_path / "traced_helper.py"), str(tmp_path / "traced_model.py")} <= files
    assert not entry._artifacts.source_info.inlined_sources
    assert [s.module for s in outside.inlined_sources] == ["traced_model"]


def test_unread_compile_logs_skipped(monkeypatch):
    """Inside the block AOTAutograd prints no graph and Dynamo times no guards; with the aot_graphs log
    on, or outside the block, torch's own code runs."""
    import logging

    from torch.fx import GraphModule

    printed = []
    original_print = GraphModule.print_readable
    monkeypatch.setattr(GraphModule, "print_readable", lambda self, *a, **k: printed.append(1) or original_print(self, *a, **k))

    def compile_once() -> int:
        printed.clear()
        torch._dynamo.reset()
        torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager")(torch.ones(3, requires_grad=True)).backward()
        return len(printed)

    try:
        with tp.unread_compile_logs_skipped():
            assert compile_once() == 0
            profile = torch._dynamo.guards.profile_guard_manager
            assert getattr(profile, "_accelrun_skips", False) and profile(None, None, 1) == 0.0  # torch's: a crash
            graphs_log = torch._functorch._aot_autograd.graph_compile.aot_graphs_log
            level = graphs_log.level
            graphs_log.setLevel(logging.INFO)  # setLevel: isEnabledFor caches its answers
            try:
                assert compile_once() >= 2  # the forward and the backward graph, for the log
            finally:
                graphs_log.setLevel(level)
        assert compile_once() >= 3  # and the joint graph, for the AOTAutograd cache
    finally:
        torch._dynamo.reset()


def test_dynamo_counters():
    # coverage.py reads these three: frames seen and compiled, unimplemented, graph breaks.
    torch._dynamo.reset()
    before = tp.dynamo_counters["frames"]["total"]
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    assert tp.dynamo_counters["frames"]["total"] > before
    assert isinstance(tp.dynamo_counters["graph_break"], dict) and isinstance(tp.dynamo_counters["unimplemented"], dict)
    torch._dynamo.reset()


def test_dynamo_compile_callbacks():
    # compile/activity.py: a start before Dynamo traces a frame and an end after it, once per compile.
    torch._dynamo.reset()
    seen = []

    def start(_args):
        seen.append("start")

    def end(_args):
        seen.append("end")

    tp.dynamo_compile_callbacks.register_start_callback(start)
    tp.dynamo_compile_callbacks.register_end_callback(end)
    try:
        torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.ones(2))
    finally:
        tp.dynamo_compile_callbacks.remove_start_callback(start)
        tp.dynamo_compile_callbacks.remove_end_callback(end)
        torch._dynamo.reset()
    assert seen == ["start", "end"]


def test_saved_tensors_hooks_paused():
    # compile/backend.py: ops with grad under it call no hook of the caller's, also where hooks are
    # disabled (pushing identity hooks there raised).
    packed = []
    x = torch.ones(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        x.exp()
        assert len(packed) == 1
        with tp.saved_tensors_hooks_paused():
            x.exp()
    assert len(packed) == 1
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"), tp.saved_tensors_hooks_paused():
        x.exp()


def test_traces_host_reads():
    # Read by model code inside a traced forward (the MoE's experts): a constant of the trace, no break.
    assert tp.traces_host_reads() is False  # torch's default

    def fn(x):
        return x * 2 if tp.traces_host_reads() else x * 3

    for capture, want in ((True, 2.0), (False, 3.0)):
        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_scalar_outputs=capture):
            got = torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
        assert float(got[0]) == want
    torch._dynamo.reset()


# --- fake tensors and tracing contexts ----------------------------------------------------------------


def test_FakeTensorMode():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with tp.FakeTensorMode(shape_env=ShapeEnv()):
        t = torch.empty(3, 4)
    assert t.shape == (3, 4) and type(t).__name__ == "FakeTensor"


def test_unset_fake_temporarily():
    with tp.FakeTensorMode(), tp.unset_fake_temporarily():
        t = torch.ones(2)
    assert type(t) is torch.Tensor and t.sum().item() == 2


def test_optimization_hint():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    size = shape_env.create_symintnode(shape_env.create_symbol(5, ConstantSource("s")), hint=5)
    assert isinstance(size, torch.SymInt) and tp.optimization_hint(size) == 5 and tp.optimization_hint(7) == 7
    assert not shape_env.guards  # read without a guard (int() would add one)


def test_detect_fake_mode():
    mode = tp.FakeTensorMode()
    with mode:
        t = torch.empty(2)
    assert tp.detect_fake_mode([t]) is mode
    assert tp.detect_fake_mode([torch.ones(1)]) is None


def test_CompileContext():
    seen = []

    def backend(gm, example_inputs):
        seen.append(tp.CompileContext.current_compile_id())
        return gm

    assert tp.CompileContext.current_compile_id() is None  # outside a compile
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, backend=backend)
    f(torch.ones(3))
    f(torch.ones(3, 4))  # a recompile of the same frame
    assert [c.frame_id for c in seen] == [seen[0].frame_id] * 2 and [c.frame_compile_id for c in seen] == [0, 1]
    torch._dynamo.reset()


def test_tracing():
    with tp.tracing(None):  # the inductor executor opens a fresh context this way
        pass


def test_is_traceable_wrapper_subclass():
    # merge_parallel_linears declines weights that are wrapper subclasses (DTensor shards)
    assert _params(tp.is_traceable_wrapper_subclass) == ["t"]
    assert not tp.is_traceable_wrapper_subclass(torch.ones(1))
    assert not tp.is_traceable_wrapper_subclass(torch.nn.Parameter(torch.ones(1)))


# --- fx ----------------------------------------------------------------------------------------------


def test_LazyGraphModule():
    from torch import fx

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.mul.Tensor, (x, x)))
    gm = tp.LazyGraphModule(torch.nn.Module(), graph)
    assert isinstance(gm, fx.GraphModule) and type(gm)._needs_recompile()  # no code written yet
    tp.LazyGraphModule.force_recompile(gm)
    assert not type(gm)._needs_recompile() and "mul" in gm.code
    assert torch.equal(gm.forward(torch.tensor([3.0])), torch.tensor([9.0]))
    gm.recompile()  # after a rewrite: marked, written on the next use
    assert type(gm)._needs_recompile()
    assert torch.equal(gm(torch.tensor([2.0])), torch.tensor([4.0])) and not type(gm)._needs_recompile()


def test_use_lazy_graph_module():
    from torch.fx._lazy_graph_module import _make_graph_module

    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    with tp.use_lazy_graph_module(True):
        gm = _make_graph_module(torch.nn.Module(), graph)
    assert isinstance(gm, tp.LazyGraphModule)


def test_GraphPickler():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    gm = torch.fx.symbolic_trace(Double())
    data = tp.GraphPickler.dumps(gm, tp.GraphPicklerOptions(ops_filter=None))
    back = tp.GraphPickler.loads(data, tp.FakeTensorMode(shape_env=ShapeEnv()))
    back.recompile()  # as AccelrunOutputCode does after loading
    assert torch.equal(back(torch.ones(2)), torch.full((2,), 2.0))


def test_GraphPicklerOptions():
    assert "ops_filter" in _params(tp.GraphPicklerOptions)


# --- sympy index functions ------------------------------------------------------------------------------


def test_FloorDiv():
    i = sympy.Symbol("i", integer=True, nonnegative=True)
    assert tp.FloorDiv(7, 2) == 3
    assert isinstance(tp.FloorDiv(i, 4), sympy.Expr)


def test_IndexMod():
    i = sympy.Symbol("i", integer=True, nonnegative=True)
    assert tp.IndexMod(7, 4) == 3
    assert isinstance(tp.IndexMod(i, 4), sympy.Expr)


# --- distributed, models ------------------------------------------------------------------------------


def test_functional_collectives():
    funcol = tp.functional_collectives
    for name in ("wait_tensor", "AsyncCollectiveTensor"):
        assert hasattr(funcol, name), name
    assert hasattr(funcol, "all_gather_single_autograd") or hasattr(funcol, "all_gather_tensor_autograd")
    # dist/tp.py waits on the TP embedding's output with it inside autograd: without a backward for
    # wait_tensor the embedding would get no gradient
    x = torch.ones(2, requires_grad=True)
    funcol.wait_tensor(x * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_compute_local_shape_and_global_offset():
    params = list(_params(tp.compute_local_shape_and_global_offset))
    assert params[:3] == ["global_shape", "mesh", "placements"]


def test_FakeStore():
    import torch.distributed as dist

    assert dist.is_initialized() or "fake" in dist.Backend.backend_list  # importing it registered "fake"
    assert callable(tp.FakeStore)


def test_grouped_mm():
    x_MI, w_GIO = torch.randn(5, 4), torch.randn(2, 4, 8)  # strides of 16-byte multiples, as it needs
    offsets_G = torch.tensor([2, 5], dtype=torch.int32)  # rows 0-1 to expert 0, 2-4 to expert 1
    try:
        y = tp.grouped_mm(x_MI, w_GIO, offs=offsets_G)
    except RuntimeError as e:  # a CPU build without it: the MoE's bmm path runs there
        pytest.skip(f"torch._grouped_mm does not run on this CPU: {e}")
    torch.testing.assert_close(y, torch.cat([x_MI[:2] @ w_GIO[0], x_MI[2:] @ w_GIO[1]]))


# --- CUDA and Triton ----------------------------------------------------------------------------------


def test_cuda_current_raw_stream():
    if not torch.cuda.is_available():
        pytest.skip("a CPU build of torch has no CUDA streams")
    assert tp.cuda_current_raw_stream(0) == torch.cuda.current_stream(0).cuda_stream


def test_cpu_has_half_gemm():
    # ATen's own checks, on the tested range (an AttributeError here: renamed or gone).
    for dtype in (torch.bfloat16, torch.float16):
        assert isinstance(tp.cpu_has_half_gemm(dtype), bool)
    # On x86 ATen's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: the answer follows the CPU's flags
    # (the cpu_half_gemm pass's tests force both answers).
    if platform.machine() != "x86_64" or not os.path.exists("/proc/cpuinfo"):
        pytest.skip("reads x86 feature flags from Linux's /proc/cpuinfo")
    with open("/proc/cpuinfo") as f:
        flags = set(next(ln for ln in f if ln.startswith("flags")).split())
    bf16_kernels = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert tp.cpu_has_half_gemm(torch.bfloat16) == bf16_kernels


def test_onednn_linear():
    op = tp.onednn_linear()
    assert op is not None, "the tested torch builds have oneDNN on x86 and ARM"
    g = torch.Generator().manual_seed(0)
    x, bias = torch.randn(64, 48, generator=g), torch.randn(40, generator=g)
    for weight in (torch.randn(40, 48, generator=g), torch.randn(48, 40, generator=g).t()):  # both orders
        expected = x.double() @ weight.double().t() + bias.double()
        torch.testing.assert_close(op(x, weight, bias, "none", [], "").double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(op(x, weight, None, "none", [], "").double(), expected - bias.double(),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
    column_major = torch.randn(48, 64, generator=g).t()  # an input read transposed (a weight gradient's)
    torch.testing.assert_close(op(column_major, weight, None, "none", [], ""), column_major @ weight.t())
    with tp.FakeTensorMode():  # the meta kernel the compiler's graphs trace through
        out = op(torch.empty(64, 48), torch.empty(40, 48), None, "none", [], "")
    assert tuple(out.shape) == (64, 40) and out.dtype == torch.float32


def test_triton_direct_launch():
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    # TritonRegion's later launches call run() exactly as triton.jit's own launch does.
    source = inspect.getsource(JITFunction.run)
    assert "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata," \
           in source.replace("\n", " ").replace("  ", " ").replace("  ", " ")  # fmt: skip
    assert "kernel.launch_metadata(grid, stream, " in source

    class Launched:
        run, function, packed_metadata = object(), object(), object()

    assert tp.triton_direct_launch(Launched()) == (Launched.run, Launched.function, Launched.packed_metadata)
    assert tp.triton_direct_launch(object()) is None


def test_triton_knobs():
    pytest.importorskip("triton")
    hooks = tp.triton_knobs.runtime
    assert hasattr(hooks, "launch_enter_hook") and hasattr(hooks, "launch_exit_hook")


def test_TritonAsyncCompileMode():
    """triton_aot.parallel_compiles: inside the mode, triton.jit hands each compile to ``submit`` (a key,
    the compile, what to do with its result, what to do on failure) and gets a future kernel back;
    leaving the mode waits for every compile and finishes each (puts the kernel in the JIT's cache);
    with ``ignore_errors`` a failed compile is cleaned up and leaving raises nothing."""
    pytest.importorskip("triton")
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime.jit import JITFunction

    assert "_async_compile.active_mode.get()" in inspect.getsource(JITFunction._do_compile)
    finished, cleaned = [], []

    def fail():
        raise RuntimeError("rejected")

    # Triton 3.7 on: a fourth callable cleans up a failed compile's placeholder (3.6 makes none).
    with_cleanup = len(_params(tp.TritonAsyncCompileMode.submit)) == 5
    cleanup = (cleaned.append,) if with_cleanup else ()
    with ThreadPoolExecutor(2) as pool:
        mode = tp.TritonAsyncCompileMode(pool, ignore_errors=True)
        with mode:
            assert tp.triton_async_compile_active.get() is mode
            futures = [mode.submit(k, lambda k=k: k * 10, finished.append, *cleanup) for k in (1, 2)]
            failed = mode.submit(3, fail, finished.append, *cleanup)
    assert tp.triton_async_compile_active.get() is None
    assert sorted(finished) == [10, 20] and [f.result() for f in futures] == [10, 20]
    assert failed.kernel is None and cleaned == ([failed] if with_cleanup else [])


def test_triton_async_compile_active():
    pytest.importorskip("triton")
    assert tp.triton_async_compile_active.get() is None  # a ContextVar: nothing in force outside a mode
    assert hasattr(tp.triton_async_compile_active, "set")


def test_TritonFutureKernel():
    """What ``drop_failed_async_compiles`` reads of a cache's placeholder: its kernel and its future."""
    pytest.importorskip("triton")
    callbacks = [lambda k: None] * (len(_params(tp.TritonFutureKernel.__init__)) - 2)  # finish (3.7 on: clean up)
    placeholder = tp.TritonFutureKernel(*callbacks, future=None)
    assert placeholder.kernel is None and placeholder.future is None


def test_drop_failed_async_compiles():
    """A JIT function's per-device caches are tuples whose first item is the kernel cache (what
    ``JITFunction.run`` unpacks); a failed compile's placeholder has neither kernel nor future."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    assert "kernel_cache, kernel_key_cache, target, backend, binder = self.device_caches[device]" in \
        inspect.getsource(JITFunction.run)  # fmt: skip
    future_kernel = tp.TritonFutureKernel
    callbacks = [lambda k: None] * (len(_params(future_kernel.__init__)) - 2)  # finish (and, 3.7 on, clean up)
    dead, built = future_kernel(*callbacks, future=None), future_kernel(*callbacks, future=None)
    built.kernel = "a compiled kernel"
    cache = {"failed": dead, "built": built, "plain": "a compiled kernel"}
    jit = SimpleNamespace(device_caches={0: (cache, {}, None, None, None)})
    assert tp.drop_failed_async_compiles(jit) == 1 and set(cache) == {"built", "plain"}
    assert tp.drop_failed_async_compiles(SimpleNamespace()) == 0


def test_GPUTarget():
    pytest.importorskip("triton")
    target = tp.GPUTarget("cuda", 90, 32)
    assert (target.backend, target.arch, target.warp_size) == ("cuda", 90, 32)


def test_ASTSource():
    pytest.importorskip("triton")
    assert list(_params(tp.ASTSource.__init__))[1:] == ["fn", "signature", "constexprs", "attrs"]


def test_get_ptxas():
    pytest.importorskip("triton")
    assert list(_params(tp.get_ptxas)) == ["arch"]


def test_TensorHandle():
    pytest.importorskip("triton")
    import numpy as np
    import triton.language as tl

    handle = tp.TensorHandle(np.ones(3, dtype=np.float32), tl.float32)
    assert handle.data.shape == (3,) and handle.dtype == tl.float32


def test_modules_with_hooks():
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    assert tp.modules_with_hooks(outer) == []
    outer.register_forward_hook(lambda m, a, o: o)  # the owner's own: runs outside its compiled forward
    assert tp.modules_with_hooks(outer) == []
    handles = [outer[1][0].register_forward_pre_hook(lambda m, a: None),
               outer[0].register_full_backward_hook(lambda m, gi, go: None)]
    assert tp.modules_with_hooks(outer) == ["0", "1.0"]
    for h in handles:
        h.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: o)
    try:
        assert tp.modules_with_hooks(outer) == ["torch.nn (global forward hooks)"]
    finally:
        handle.remove()


def test_module_hook_guards():
    """Under it, a graph traced without a hook is not reused once a module inside has one (by default
    torch skips those guards and the hook is never called)."""
    torch._dynamo.reset()
    inner = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(inner)
    x = torch.ones(1, 2)
    with tp.module_hook_guards():
        compiled = torch.compile(outer, backend="eager")
        compiled(x)
        inner.register_forward_hook(lambda m, a, o: o + 100)
        torch.testing.assert_close(compiled(x), outer(x))
    torch._dynamo.reset()


def test_dynamo_graph_break_log():
    import logging

    assert isinstance(tp.dynamo_graph_break_log, logging.Logger)
    assert tp.dynamo_graph_break_log.artifact_name == "graph_breaks"  # what TORCH_LOGS=graph_breaks turns on


def test_dynamo_frame_break_log():
    import logging

    assert isinstance(tp.dynamo_frame_break_log, logging.Logger)
    assert tp.dynamo_frame_break_log.artifact_name == "graph_breaks"


def test_DynamoTorchRuntimeError():
    """A model's error on fake tensors: ``.msg`` quotes the error, ``.real_stack`` holds the model's frames."""
    def bad(x):
        return x @ torch.ones(3, 2)

    torch._dynamo.reset()
    with pytest.raises(tp.DynamoTorchRuntimeError) as raised:
        torch.compile(bad, backend="eager")(torch.ones(2, 4))
    assert "got RuntimeError(" in raised.value.msg
    assert any(f.filename == __file__ and f.name == "bad" for f in raised.value.real_stack)


def test_DynamoUnsupported():
    """What fullgraph=True raises at a break: ``.msg`` starts with the reason, ``.real_stack`` holds the frames."""
    def branchy(x):
        if x.sum() > 0:
            return x + 1
        return x

    torch._dynamo.reset()
    with pytest.raises(tp.DynamoUnsupported) as raised:
        torch.compile(branchy, backend="eager", fullgraph=True)(torch.ones(2))
    assert raised.value.msg.splitlines()[0].strip() == "Data-dependent branching"
    assert any(f.filename == __file__ and f.name == "branchy" for f in raised.value.real_stack)


def test_DynamoUserError():
    """What fullgraph=True raises at a branch on a value read from a tensor: "data-dependent expression"
    in its text, ``.real_stack`` holds the frames."""
    def reads(x):
        if x.sum().item() > 0:
            return x + 1
        return x

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True), pytest.raises(tp.DynamoUserError) as raised:
        torch.compile(reads, backend="eager", fullgraph=True)(torch.ones(2))
    assert "data-dependent expression" in str(raised.value)
    assert any(f.filename == __file__ and f.name == "reads" for f in raised.value.real_stack)


def test_fake_tensor_log():
    import logging

    assert isinstance(tp.fake_tensor_log, logging.Logger) and tp.fake_tensor_log.name == "torch._subclasses.fake_tensor"


def test_dynamo_tensor_log():
    import logging

    from torch._dynamo.variables.tensor import TensorVariable

    assert isinstance(tp.dynamo_tensor_log, logging.Logger)
    assert tp.dynamo_tensor_log.name == "torch._dynamo.variables.tensor"
    # The hint for `Tensor.item()` that break_sites._NoItemHint keeps off the console is logged there.
    assert "Graph break from `Tensor.item()`" in inspect.getsource(TensorVariable._warn_capture_scalar_outputs)


def test_DynamoInstructionTranslator():
    """While Dynamo traces a frame, ``current_tx()`` is its tracer: the frame's code and the line it is at."""
    seen = []

    def backend(gm, example_inputs):
        tx = tp.DynamoInstructionTranslator.current_tx()
        seen.append((tx.f_code.co_name, tx.lineno))
        return gm

    def traced(x):
        return x + 1

    torch.compile(traced, backend=backend)(torch.ones(2))
    assert seen and seen[0][0] == "traced" and isinstance(seen[0][1], int)


def test_COMPILED_CALL():
    """Module.compile keeps the compiled call there, and Module.__call__ calls what is there."""
    module = torch.nn.Linear(2, 2)
    assert getattr(module, tp.COMPILED_CALL) is None
    module.compile(backend="eager")
    assert callable(getattr(module, tp.COMPILED_CALL))
    called = []
    setattr(module, tp.COMPILED_CALL, lambda *a, **k: called.append(a) or "reached")
    assert module(torch.ones(2)) == "reached" and len(called) == 1


def _dies_once(marker: str) -> None:
    """A worker of the agent: local rank 1 of the first start kills itself, as `kill -9` would."""
    if os.environ["LOCAL_RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), 9)
    open(f"{marker}-{os.environ['LOCAL_RANK']}-{os.environ['TORCHELASTIC_RESTART_COUNT']}", "w").close()


def test_on_group_restart(tmp_path):
    """torchelastic's agent, as `accelrun train --max-restarts` runs it: the report gets the killed rank's
    signal before the group restarts, and the restarted group runs to the end."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    seen = []
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="t", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=1, monitor_interval=0.05, start_method="fork")
    with tp.on_group_restart(lambda codes, restart, most: seen.append((codes, restart, most))):
        elastic_launch(config, _dies_once)(str(tmp_path / "done"))
    # the rank that failed; rank 0 had finished (0) or was still running, and the agent's stopping it
    # afterwards is not counted as a failure
    assert len(seen) == 1 and seen[0][0].get(1) == -9 and seen[0][0].get(0, 0) == 0 and seen[0][1:] == (1, 1), seen
    written = {p.name for p in tmp_path.iterdir()}
    assert {"done-0-1", "done-1-1"} <= written and "done-1-0" not in written, written


def test_agent_exit_codes():
    """The agent keeps its processes at ``_pcontext._pc.processes`` (multiprocessing's, with ``exitcode``);
    test_on_group_restart reads them from a real agent."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    assert "self._pcontext" in inspect.getsource(LocalElasticAgent.__init__)
    assert "self._pc" in inspect.getsource(MultiprocessContext.__init__)
    procs = [SimpleNamespace(exitcode=None), SimpleNamespace(exitcode=-9), SimpleNamespace(exitcode=0)]
    assert tp.agent_exit_codes(SimpleNamespace(_pcontext=SimpleNamespace(_pc=SimpleNamespace(processes=procs)))) \
        == {1: -9, 2: 0}
    assert tp.agent_exit_codes(SimpleNamespace()) == {}


def test_OptimizedModule():
    linear = torch.nn.Linear(2, 2)
    compiled = torch.compile(linear, backend="eager")
    assert isinstance(compiled, tp.OptimizedModule) and compiled._orig_mod is linear


def test_DynamoRestartAnalysis():
    """What Dynamo raises through a backend when it abandons the graph and traces the frame again."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    assert issubclass(TensorifyScalarRestartAnalysis, tp.DynamoRestartAnalysis)

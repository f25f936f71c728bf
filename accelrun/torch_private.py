"""Every private torch and Triton symbol accelrun uses, imported here and nowhere else.

accelrun's compiler works below torch.compile's public surface: AOTAutograd's entry point and
partitioner, Inductor's output-code protocol, Dynamo's C++ guards and allocator, fx's graph pickler,
Triton's cross-compiler and launcher. None of them is a stable API: any torch or Triton release may
move, rename or reshape one. Keeping them here means a new release fails one named test
(``tests/test_torch_private.py``: one test per symbol, on the shape accelrun relies on) instead of a
user's run; ``pyproject.toml`` pins the torch range those tests passed on.

Two kinds:

- ``torch._C`` members that load with torch itself: plain attributes, None where this build has none
  (their users keep a slower public path then).
- Everything else: imported on first use through ``PRIVATE`` (Inductor, the precompile machinery and
  Triton take seconds to import, and most runs never touch them)::

      from accelrun.torch_private import default_partition

Left out on purpose, as torch's de facto public surface: ``torch._ops.OpOverload`` (the type of every
``torch.ops.aten.*`` overload, checked with isinstance), ``torch._foreach_*`` (the multi-tensor ops
torch.optim and clip_grad_norm_ run on), ``torch._C._nn.linear`` / ``silu`` (what Dynamo records for
F.linear / F.silu, matched by the pattern tables), operators under ``torch.ops``, and
``torch._dynamo.reset`` / ``torch.compile``'s own entry points.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_GUARDS = getattr(torch._C._dynamo, "guards", None)

# (base, sizes, strides, storage_offset) -> a view of base: as_strided without the argument parser,
# used as a graph node target for collapsed view chains (fast_calls).
reinterpret_tensor = getattr(_GUARDS, "_reinterpret_tensor", None)
# (sizes, strides, dtype) -> an uninitialised CPU tensor: Dynamo's allocator, what Inductor's
# generated code calls; half the cost of torch.empty_strided (a C++ region's outputs).
empty_strided_cpu = getattr(_GUARDS, "_empty_strided_cpu", None)
# TensorGuards(*tensors, dynamic_dims_sizes=, dynamic_dims_strides=).check(*tensors) -> bool: one C++
# call that checks dtype, device, sizes and strides of all of a region's inputs.
TensorGuards = getattr(_GUARDS, "TensorGuards", None)


# name -> (module, attribute; None: the module itself). Read by __getattr__ on first use.
PRIVATE: dict[str, tuple[str, str | None]] = {
    # AOTAutograd: the joint graph, its cut into forward and backward, and their calling convention.
    "aot_module_simplified": ("torch._functorch.aot_autograd", "aot_module_simplified"),
    "make_boxed_func": ("torch._functorch.aot_autograd", "make_boxed_func"),
    "default_partition": ("torch._functorch.partitioners", "default_partition"),
    "SavedForBackwardsAOTOutput": ("torch._functorch._aot_autograd.descriptors", "SavedForBackwardsAOTOutput"),
    # A forward output that is an input's new value (``.mutated_input``: that input's description, as its
    # placeholder's meta["desc"]): remat reads no input the forward changes.
    "InputMutationAOTOutput": ("torch._functorch._aot_autograd.descriptors", "InputMutationAOTOutput"),
    "SerializableAOTDispatchCompiler": ("torch._functorch._aot_autograd.schemas", "SerializableAOTDispatchCompiler"),
    # AOTAutograd's settings; accelrun sets force_non_lazy_backward_lowering (compile the backward graph
    # with the forward, not at the first backward).
    "functorch_config": ("torch._functorch.config", None),
    # Core ATen decompositions without the entries export adds for CompositeImplicitAutograd ops, which
    # the dispatcher decomposes before AOTAutograd's tracer sees them (building those takes 0.2 s).
    "core_aten_decompositions_post_autograd": ("torch._decomp", "_core_aten_decompositions_post_autograd"),
    # Inductor: the output-code protocol precompile saves, the region executor, its cache folder.
    "OutputCode": ("torch._inductor.output_code", "OutputCode"),
    "compile_fx_inner": ("torch._inductor.compile_fx", "compile_fx_inner"),
    # The decompositions Inductor expects done before compile_fx_inner (it lowers no ``_softmax`` itself).
    "inductor_decompositions": ("torch._inductor.decomposition", "select_decomp_table"),
    "temporary_cache_dir": ("torch._inductor.runtime.cache_dir_utils", "temporary_cache_dir"),
    # Dynamo: precompiled frames (the graph cache) and its process-wide counters (coverage).
    "AOTCompiledFunction": ("torch._dynamo.aot_compile", "AOTCompiledFunction"),
    "BundledAOTAutogradSerializableCallable": ("torch._dynamo.aot_compile_types",
                                               "BundledAOTAutogradSerializableCallable"),
    "dynamo_counters": ("torch._dynamo.utils", "counters"),
    # What precompile records of each function it traced (``files_traced_by_precompile``).
    "SourceInfo": ("torch._dynamo.package", "SourceInfo"),
    # Its UNSUPPORTED_SERIALIZATION_GUARD_TYPES: the guard kinds precompile cannot save (what its default
    # guard filter drops), where the graph cache's own filter starts.
    "CheckFunctionManager": ("torch._dynamo.guards", "CheckFunctionManager"),
    # Fake tensors and tracing contexts.
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "unset_fake_temporarily": ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    # A symbolic size's example value without the guard ``int()`` adds (debug_numerics' sample inputs).
    "optimization_hint": ("torch.fx.experimental.symbolic_shapes", "optimization_hint"),
    "detect_fake_mode": ("torch._guards", "detect_fake_mode"),
    "tracing": ("torch._guards", "tracing"),
    # The compile Dynamo has under way (``current_compile_id()``: its frame and that frame's compile count),
    # read by the backend to count the graphs it compiled per frame.
    "CompileContext": ("torch._guards", "CompileContext"),
    "is_traceable_wrapper_subclass": ("torch.utils._python_dispatch", "is_traceable_wrapper_subclass"),
    # An fx GraphModule that writes and compiles its Python code when it first runs or is read, not when
    # it is made: a graph loaded from the graph cache is copied for fast_calls and rewritten after its
    # recorded calls, and each eager codegen of it cost ~10 ms of a new process's first step.
    "LazyGraphModule": ("torch.fx._lazy_graph_module", "_LazyGraphModule"),
    # Inside it, the GraphModules torch makes (AOTAutograd's forward and backward) are LazyGraphModules.
    "use_lazy_graph_module": ("torch.fx._lazy_graph_module", "_use_lazy_graph_module"),
    # fx graphs saved with the graph cache.
    "GraphPickler": ("torch.fx._graph_pickler", "GraphPickler"),
    "GraphPicklerOptions": ("torch.fx._graph_pickler", "Options"),
    # Index arithmetic of the loop IR: torch's integer floor division and modulus for sympy.
    "FloorDiv": ("torch.utils._sympy.functions", "FloorDiv"),
    "IndexMod": ("torch.utils._sympy.functions", "Mod"),
    # Triton: cross-compiling for a GPU that is not here, and the interpreter's values.
    "GPUTarget": ("triton.backends.compiler", "GPUTarget"),
    "ASTSource": ("triton.compiler", "ASTSource"),
    "get_ptxas": ("triton.backends.nvidia.compiler", "get_ptxas"),
    "TensorHandle": ("triton.runtime.interpreter", "TensorHandle"),
    "triton_knobs": ("triton.knobs", None),
    # Triton's compiles of ``kernel.warmup`` / first launches on a pool of threads: its compiler (MLIR
    # passes, ptxas) runs outside the GIL, so a tuning's candidates build side by side.
    "TritonAsyncCompileMode": ("triton.runtime._async_compile", "AsyncCompileMode"),
    "triton_async_compile_active": ("triton.runtime._async_compile", "active_mode"),  # the mode in force
    "TritonFutureKernel": ("triton.runtime._async_compile", "FutureKernel"),  # a kernel cache's placeholder
    # Dynamo's start and end of every compile it runs (a frame, a lazy backward, a CUDA graph's recording):
    # ``register_start_callback`` / ``register_end_callback`` of one-argument callables, called once for
    # the outermost of nested compiles (what a progress line reads, compile/activity.py).
    "dynamo_compile_callbacks": ("torch._dynamo.callback", "callback_handler"),
    # A context in which autograd calls no saved-tensor hooks (what Dynamo and AOTAutograd trace under):
    # the backend's passes run ops on fake values inside the caller's hooks (torch.utils.checkpoint's).
    "saved_tensors_hooks_paused": ("torch._dynamo.utils", "_disable_saved_tensors_hooks_during_tracing"),
    # Dynamo's loggers: each graph break with the user's stack (its `graph_breaks` artifact, printed only
    # under TORCH_LOGS), and the one that prints its own hint for `Tensor.item()` (compile/break_sites.py).
    "dynamo_graph_break_log": ("torch._dynamo.symbolic_convert", "graph_break_log"),
    "dynamo_frame_break_log": ("torch._dynamo.convert_frame", "graph_break_log"),
    "dynamo_tensor_log": ("torch._dynamo.variables.tensor", "log"),
    # A model's own error met on fake tensors while Dynamo traces it (``.msg``, and ``.real_stack``: the
    # user's frames), and the log that prints each such failure with its traceback first.
    "DynamoTorchRuntimeError": ("torch._dynamo.exc", "TorchRuntimeError"),
    # What Dynamo cannot trace, raised instead of a graph break under fullgraph=True (``.msg``: the reason
    # first, then its explanation and hints; ``.real_stack``: the user's frames).
    "DynamoUnsupported": ("torch._dynamo.exc", "Unsupported"),
    # What Dynamo refuses under fullgraph at a branch on a value read from a tensor (``.item()`` compared):
    # it cannot guard on the data-dependent expression; ``.real_stack`` as above.
    "DynamoUserError": ("torch._dynamo.exc", "UserError"),
    # Raised through a backend when Dynamo abandons the graph it handed over and traces the frame again
    # (a Python float read from a tensor turned into a tensor input: TensorifyScalarRestartAnalysis).
    "DynamoRestartAnalysis": ("torch._dynamo.exc", "RestartAnalysis"),
    "fake_tensor_log": ("torch._subclasses.fake_tensor", "log"),
    # The frame Dynamo is tracing (``current_tx()``: its ``f_code`` and ``lineno``), read while a break is
    # logged: the log's traceback can leave out the user's own forward.
    "DynamoInstructionTranslator": ("torch._dynamo.symbolic_convert", "InstructionTranslator"),
    # Distributed: functional collectives (what compiled graphs hold), a DTensor shard's place in the
    # global tensor (shard-exact initialisation), the fake process group (the dry run).
    "functional_collectives": ("torch.distributed._functional_collectives", None),
    "compute_local_shape_and_global_offset": ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    # Models: one matmul per expert group without padding (the MoE's grouped_mm implementation).
    "grouped_mm": ("torch", "_grouped_mm"),
    # What ``torch.compile(module)`` returns: a user's factory that compiled its model itself (``_orig_mod``
    # is the module inside).
    "OptimizedModule": ("torch._dynamo.eval_frame", "OptimizedModule"),
}


def __getattr__(name: str) -> Any:
    where = PRIVATE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attr = where
    module = importlib.import_module(module_name)  # ImportError (Triton absent, say) goes to the caller
    try:
        value = module if attr is None else getattr(module, attr)
    except AttributeError:
        raise ImportError(f"accelrun needs {module_name}.{attr}, which torch {torch.__version__} does not have "
                          "(the torch range accelrun is tested on is in its pyproject.toml)") from None
    globals()[name] = value  # looked up once
    return value


def traces_host_reads() -> bool:
    """Whether Dynamo, if it is tracing now, takes a value read on the host (``.tolist()``, ``.item()``)
    into the graph as a number read at run time, rather than breaking the graph there. accelrun sets it
    for its whole-graph traces (the graph cache's, ``compile.fullgraph``), where Dynamo captures such
    reads anyway; read inside a traced forward, Dynamo takes it as a constant of that trace."""
    return bool(torch._dynamo.config.capture_scalar_outputs)


def cuda_current_raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device as an integer handle, what Triton's launcher takes (the public
    ``torch.cuda.current_stream().cuda_stream`` builds a Stream object on every call)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def cpu_has_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has oneDNN's kernels for ``dtype`` (bf16 or fp16) matrix products, else ATen runs
    a generic loop, tens of times slower than fp32. ``torch.ops.mkldnn._is_mkldnn_*_supported`` is the
    check ATen makes itself; on x86, bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and fp16 needs
    AVX512-FP16 or AVX-NE-CONVERT, so a plain AVX-512 CPU has bf16 kernels but not fp16 ones."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    op = getattr(torch.ops.mkldnn, check, None) if torch.backends.mkldnn.is_available() else None
    return bool(op()) if op is not None else False


def onednn_linear() -> Any:
    """oneDNN's linear layer on dense CPU tensors, ``(input, weight, bias, "none", [], "") -> input @
    weight.T + bias`` (``torch.ops.mkldnn._linear_pointwise``, what Inductor's CPU inference fusions
    call), or None where this torch has no oneDNN. fp32 in and out, strided inputs taken as they are;
    it has a meta kernel, so fake tensors trace through it."""
    if not torch.backends.mkldnn.is_available():
        return None
    packet = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return getattr(packet, "default", None)


# Where Module.compile keeps the compiled call that Module.__call__ reaches (torch 2.11-2.13): wrapped for
# the first call's fallback (compile_model) and to trace as the graph cache does (trace_settings).
COMPILED_CALL = "_compiled_call_impl"

# nn.Module's hook dicts (each module's, and the process-wide ones of torch.nn.modules.module): Dynamo
# traces the hooks of the modules a compiled method calls into its graph.
MODULE_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def modules_with_hooks(owner: torch.nn.Module) -> list[str]:
    """Where hooks are set that a compiled ``owner.<method>`` may trace: the paths of the modules under
    ``owner`` with a hook (all of them, whether the method calls them or not), and ``"torch.nn (global
    ... hooks)"`` for hooks registered for every module. ``owner``'s own are left out: a block's hooks
    run around its ``forward`` (``Module.__call__``), outside the compiled call."""
    from torch.nn.modules import module as module_py

    found = [f"torch.nn (global {name.strip('_').replace('_', ' ')})" for name in MODULE_HOOK_DICTS
             if getattr(module_py, f"_global{name}", None)]  # fmt: skip
    for path, module in owner.named_modules():
        if module is not owner and any(getattr(module, name, None) for name in MODULE_HOOK_DICTS):
            found.append(path)
    return found


@contextlib.contextmanager
def no_donated_buffers() -> Iterator[None]:
    """AOTAutograd compiles inside without donated buffers (saved tensors its backward may reuse), and the
    graphs it compiled say so. A backward compiled with the forward (``force_non_lazy_backward_lowering``)
    that donates refuses ``backward(retain_graph=True)``; one compiled lazily drops its donations then.
    Compiled with the setting off, the graph's metadata says None rather than none (``[]``), which the
    backward reads, with the setting back on, as donations: so it is set to none once compiled."""
    from torch._guards import TracingContext

    with torch._functorch.config.patch(donated_buffer=False):
        yield
    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    if meta is not None and getattr(meta, "bw_donated_idxs", []) is None:
        meta.bw_donated_idxs = []


@contextlib.contextmanager
def module_hook_guards() -> Iterator[None]:
    """Dynamo's guards on module hooks, which torch skips by default (``skip_nnmodule_hook_guards``): a
    graph traced without a hook is then not reused for a module that has one. A torch without the
    setting runs as it does."""
    config = torch._dynamo.config
    if not hasattr(config, "skip_nnmodule_hook_guards"):
        yield
        return
    with config.patch(skip_nnmodule_hook_guards=False):
        yield


def import_module_globals(entry: Any) -> list[str]:
    """Make a precompiled frame (``AOTCompiledFunction``) importable in another process when Dynamo's
    bytecode loads a module through a global it put in the frame's globals under a per-process name
    (``___module_collections_<id>_c0``, for transformers' output classes): torch saves neither, and
    loading failed with "Missing required external references". Each such global is recorded among
    the frame's imports, by module name. Returns the globals recorded."""
    import dataclasses
    import types

    artifacts = entry._artifacts
    env = artifacts.runtime_env
    f_globals = entry._extra_globals or {}
    found = {ref: f_globals[ref].__name__ for ref in sorted(env.external_refs)
             if ref not in env.import_sources and isinstance(f_globals.get(ref), types.ModuleType)}  # fmt: skip
    if found:
        artifacts.runtime_env = dataclasses.replace(env, import_sources={**env.import_sources, **found})
    return list(found)


_traced_files: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("accelrun_traced_files", default=None)
_add_code_lock = threading.Lock()


@contextlib.contextmanager
def files_traced_by_precompile() -> Iterator[set[str]]:
    """The source files of every function Dynamo traces for ``aot_compile`` inside this block.

    Torch's precompile keeps, for each traced function, its lines and its module's whole source in the
    saved entry (``SourceInfo.add_code``, which tokenizes each function: 0.25 s of transformers' Llama's
    cold compile on a 2-core CPU), and ``AOTCompiledFunction`` never reads them back. Inside this block
    only the file names are kept (the graph cache checks those files when it loads an entry); outside
    it, and in other threads, torch's own ``add_code`` runs as before."""
    source_info = __getattr__("SourceInfo")
    with _add_code_lock:  # installed once: a wrapper that reads this context's collector
        if not getattr(source_info.add_code, "_accelrun_collects", False):
            original = source_info.add_code

            def add_code(self: Any, code: Any) -> None:
                files = _traced_files.get()
                if files is None:
                    return original(self, code)
                files.add(code.co_filename)

            add_code._accelrun_collects = True  # type: ignore[attr-defined]
            source_info.add_code = add_code
    files: set[str] = set()
    token = _traced_files.set(files)
    try:
        yield files
    finally:
        _traced_files.reset(token)


_skip_unread_logs: contextvars.ContextVar[bool] = contextvars.ContextVar("accelrun_skip_unread_logs", default=False)
_log_patch_lock = threading.Lock()


@contextlib.contextmanager
def unread_compile_logs_skipped() -> Iterator[None]:
    """Inside this block, torch does not build compile logs that no logger or trace will read.

    AOTAutograd prints its joint, forward and backward graphs to strings on every compile
    (``_log_joint_graph``, ``_log_fw_bw_graphs``: 35 ms of the debug Llama's 2 s cold step on a 2-core
    CPU) whatever the log settings, and Dynamo times every new guard set once after flushing the CPU's
    caches (``profile_guard_manager``, for a debug log line: 12 ms a graph). They run as torch has them
    when ``TORCH_LOGS`` asks for those logs (aot_joint_graph, aot_graphs, guards) or a structured trace
    (``TORCH_TRACE``, tlparse) is on; outside this block, and in other threads, always."""
    import logging

    graph_compile = importlib.import_module("torch._functorch._aot_autograd.graph_compile")
    guards = importlib.import_module("torch._dynamo.guards")
    trace_log = importlib.import_module("torch._logging._internal").trace_log

    def skip(*loggers: logging.Logger, level: int) -> bool:
        return (_skip_unread_logs.get() and not trace_log.handlers
                and not any(log.isEnabledFor(level) for log in loggers))  # fmt: skip

    with _log_patch_lock:  # installed once: wrappers that read this context's flag
        if not getattr(graph_compile._log_joint_graph, "_accelrun_skips", False):
            log_joint, log_fw_bw = graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs
            profile = guards.profile_guard_manager

            def _log_joint_graph(*args: Any, **kwargs: Any) -> Any:
                if skip(graph_compile.aot_joint_log, level=logging.INFO):
                    return None
                return log_joint(*args, **kwargs)

            def _log_fw_bw_graphs(*args: Any, **kwargs: Any) -> Any:
                if skip(graph_compile.aot_graphs_log, level=logging.INFO):
                    return None, None
                return log_fw_bw(*args, **kwargs)

            def profile_guard_manager(*args: Any) -> Any:
                if skip(guards.guards_log, level=logging.DEBUG):
                    return 0.0
                return profile(*args)

            for fn in (_log_joint_graph, _log_fw_bw_graphs, profile_guard_manager):
                fn._accelrun_skips = True  # type: ignore[attr-defined]
            graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs = _log_joint_graph, _log_fw_bw_graphs
            guards.profile_guard_manager = profile_guard_manager
    token = _skip_unread_logs.set(True)
    try:
        yield
    finally:
        _skip_unread_logs.reset(token)


def agent_exit_codes(agent: Any) -> dict[int, int]:
    """Exit status by local rank of a torchelastic agent's processes that have ended (negative: the
    signal that killed it; the agent keeps its last group's processes and nothing public hands them
    out); empty where this torch keeps them elsewhere. Never raises (it runs inside the agent's watch
    over its ranks)."""
    ended = {}
    try:
        procs = getattr(getattr(getattr(agent, "_pcontext", None), "_pc", None), "processes", None) or []
        for i, p in enumerate(procs):
            with contextlib.suppress(ValueError, OSError):  # a process object already closed
                if (code := p.exitcode) is not None:
                    ended[i] = code
    except Exception:  # noqa: BLE001 - another torch's layout: nothing known
        return {}
    return ended


GroupRestartReport = Callable[[dict[int, int], int, int], None]
_on_restart: contextvars.ContextVar[GroupRestartReport | None] = contextvars.ContextVar("accelrun_on_restart",
                                                                                       default=None)
_restart_patch_lock = threading.Lock()


@contextlib.contextmanager
def on_group_restart(report: GroupRestartReport) -> Iterator[None]:
    """Inside this block, torchelastic's agent calls ``report(exit_codes, restart, max_restarts)`` just
    before it restarts its worker group after a failure (``--max-restarts``): the exit status of each
    local rank that had ended by itself when the agent found the failure, by local rank (negative: the
    signal that killed it; the ranks the agent then stopped are not among them), and which restart this
    is of how many. Left to itself the agent logs only "Worker group FAILED. 3/3 attempts left", and a
    group that then finished never said that a rank had died, or which. A report that raises is ignored:
    the restart goes on."""
    api = importlib.import_module("torch.distributed.elastic.agent.server.api")
    # the agent elastic_launch runs: it looks at its processes, its base class restarts them
    agent_class = importlib.import_module("torch.distributed.elastic.agent.server.local_elastic_agent").LocalElasticAgent
    worker_state = api.WorkerState
    with _restart_patch_lock:  # installed once: wrappers that read this context's report
        if not getattr(agent_class._restart_workers, "_accelrun_reports", False):
            monitor, restart = agent_class._monitor_workers, agent_class._restart_workers

            def _monitor_workers(agent: Any, worker_group: Any) -> Any:
                # Taken before the look: on a failure the look stops the other ranks itself (SIGTERM, then
                # SIGKILL), and the failure it returns is the first it came across, which may be a rank
                # whose collective lost the rank that was killed.
                ended = agent_exit_codes(agent) if _on_restart.get() is not None else {}
                result = monitor(agent, worker_group)
                with contextlib.suppress(Exception):  # a report's bookkeeping never breaks the watch
                    failures = getattr(result, "failures", None) or {}
                    agent._accelrun_failed = {**ended, **{f.local_rank: f.exitcode for f in failures.values()}}
                return result

            def _restart_workers(agent: Any, worker_group: Any) -> None:
                said = _on_restart.get()
                if said is not None and worker_group.state in (worker_state.FAILED, worker_state.UNHEALTHY):
                    try:
                        codes = getattr(agent, "_accelrun_failed", {})
                        spec = worker_group.spec
                        said(codes, spec.max_restarts - agent._remaining_restarts, spec.max_restarts)
                    except Exception:  # noqa: BLE001 - a report never stops the restart
                        pass
                return restart(agent, worker_group)

            _restart_workers._accelrun_reports = True  # type: ignore[attr-defined]
            agent_class._monitor_workers, agent_class._restart_workers = _monitor_workers, _restart_workers
    token = _on_restart.set(report)
    try:
        yield
    finally:
        _on_restart.reset(token)


def drop_failed_async_compiles(kernel: Any) -> int:
    """Removes from a ``triton.jit`` function's kernel caches the placeholders of compiles that failed
    under Triton's asynchronous mode; returns how many. The mode compiles each compile key once, and two
    generated modules can hold kernels of one key (the same source at the same line): a failure is
    cleared from the first function's cache only, and the other keeps a placeholder with neither a
    kernel nor a future, which its next call trips over (an AttributeError) instead of compiling again
    and raising what the compiler said."""
    future_kernel = __getattr__("TritonFutureKernel")
    dropped = 0
    for caches in getattr(kernel, "device_caches", {}).values():  # per device: (kernel cache, ...)
        cache = caches[0]
        for key, value in list(cache.items()):
            if isinstance(value, future_kernel) and value.kernel is None and value.future is None:
                del cache[key]
                dropped += 1
    return dropped


def triton_direct_launch(kernel: Any) -> tuple[Any, Any, Any] | None:
    """``(run, function, packed_metadata)`` of a Triton kernel that ``triton.jit`` has launched once (its
    ``CompiledKernel``), or None where this Triton's kernels lack them. Later launches call
    ``run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
    exit_hook, *args)``, as ``JITFunction.run`` does, without its argument binding and cache lookup."""
    parts = tuple(getattr(kernel, name, None) for name in ("run", "function", "packed_metadata"))
    return None if any(p is None for p in parts) else parts  # type: ignore[return-value]

"""Apply the recipe's compile settings to a model: torch.compile with Inductor or accelrun's backend.

What gets compiled (``compile.scope``; ``auto`` picks per model, see ``resolve_scope``):

- ``block``: each repeated block (a family's layers, a user model's ``layers`` list, or the outermost
  list of two or more blocks of one user-defined class); identical blocks share one graph.
- ``loss``: the blocks as with ``block``, plus the output head and the loss as one graph of their own
  (where accelrun fuses linear + cross-entropy): the fastest for a family with a loss head.
- ``model``: the whole forward (and the loss, where the model computes it).

A user's model whose lists hold torch.nn's own modules (``nn.MultiheadAttention``, ``nn.Sequential``)
compiles its whole forward instead: Dynamo never traces a frame of torch.nn's own code on its own, so
compiling those modules one by one would compile nothing. So does one whose ``layers`` hold containers
the forward reads its modules from (``nn.ModuleDict``: never called). If the whole forward cannot be
traced either (a data-dependent branch in a loop makes Dynamo skip the frame), the first call finds out
and the repeated modules inside it are compiled one by one (``_FirstCallFallback``); if compiled blocks
never ran in the first forward (the forward calls another method of theirs), the whole forward
compiles from the next (``_WholeForwardFallback``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accelrun.compile.eager_rnns import EagerRnn, described, run_rnns_eagerly
from accelrun.compile.trace_settings import capturing_data_sized_outputs, compile_call
from accelrun.config.schema import CompileConfig
from accelrun.torch_private import COMPILED_CALL


@dataclass
class Compiled:
    description: str  # what was compiled, for the run's log and report
    record: object | None = None  # accelrun's CompileRecord (None for eager and inductor)
    backend: object | None = None


def resolve_scope(cfg: CompileConfig, model: nn.Module, blocks: list[nn.Module] | None,
                  loss_parallel: bool = False, slow_half_products: bool = False) -> tuple[str, str]:  # fmt: skip
    """(scope, why): ``compile.scope`` as given, or what ``auto`` picks for this model and backend.

    auto: a model with repeated blocks and a loss head of its own compiles them with ``loss`` under
    accelrun (the head's linear + cross-entropy fuse; with loss parallelism the head's logits are
    sharded, so ``block``); Inductor, or a model without a loss head, gets ``block``; a user's model
    without an ``nn.ModuleList`` of blocks of its own classes gets ``model``. A user's model whose
    half-precision products ATen would run in its slow generic loop (``slow_half_products``, see
    ``half_products_run_slowly``) has its output head outside the blocks, and only a compiled graph
    runs that as an fp32 GEMM (``cpu_half_gemm``): it gets ``block`` when every product outside the
    blocks is an ``nn.Linear``'s (``compile_model`` then compiles each such Linear on its own too, see
    ``_weights_outside_blocks_are_linear``), ``model`` otherwise.
    """
    if cfg.scope != "auto":
        return cfg.scope, ""
    has_blocks = blocks is not None or repeated_blocks(model) is not None
    if not has_blocks:
        return "model", "no nn.ModuleList of two or more blocks of one class with a forward of the model's own"
    head_loss = getattr(model, "head_loss", None)
    if cfg.backend == "accelrun" and slow_half_products and head_loss is None:
        # transformers' Llama in bf16-mixed on an AVX2 CPU: 5.4 s a step by its layers, 0.74 s whole;
        # by its layers and its lm_head as fast as whole, and a cold step of 2.0 s instead of 3.1.
        if _weights_outside_blocks_are_linear(model, blocks):
            return "block", ("repeated blocks; bf16/fp16 matmuls on a CPU without kernels for them: the "
                             "nn.Linear layers outside the blocks compile too, so their products run as fp32 GEMMs")
        return "model", ("bf16/fp16 matmuls on a CPU without kernels for them, and weights outside the blocks "
                         "that are no nn.Linear's: the whole forward compiles, so their products run as fp32 GEMMs")
    if cfg.backend == "accelrun" and _has_head(model) and head_loss is not None:
        if loss_parallel:
            return "block", "the loss head's logits are sharded (parallel.loss_parallel)"
        return "loss", "repeated blocks and a loss head"
    return "block", "repeated blocks" + ("" if cfg.backend == "accelrun" else f" ({cfg.backend})")


def _weights_outside_blocks_are_linear(model: nn.Module, blocks: list[nn.Module] | None) -> bool:
    """Whether every product outside the model's repeated blocks can be compiled one ``nn.Linear`` at a
    time: every matrix (or larger) parameter there belongs to an ``nn.Linear`` that no block holds too,
    or to an ``nn.Embedding`` (a lookup) beside a Linear head of its vocabulary (an embedding without
    one is most likely the head too, multiplied by in the forward's own code)."""
    if blocks is None and (found := repeated_blocks(model)) is not None:
        blocks = found[1]
    blocks = blocks or []
    inside = {id(m) for block in blocks for m in block.modules()}
    inside_params = {id(p) for block in blocks for p in block.parameters()}
    outside = _modules_outside(model, blocks)
    heads = {m.out_features for m in outside if isinstance(m, nn.Linear)}
    for module in outside:
        own = [p for p in module.parameters(recurse=False) if p.dim() >= 2 and id(p) not in inside_params]
        if isinstance(module, nn.Linear) and id(module) in inside:
            return False  # called from a block and from outside: compiled on its own it would nest compiles
        if not own or isinstance(module, nn.Linear):
            continue
        if not (isinstance(module, nn.Embedding) and module.num_embeddings in heads):
            return False
    return True


def linears_outside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The ``nn.Linear`` layers of ``model`` that are in none of ``blocks`` (an output head, an input
    projection), each once."""
    inside = {id(m) for block in blocks for m in block.modules()}
    found: dict[int, nn.Module] = {}
    for m in _modules_outside(model, blocks):
        if isinstance(m, nn.Linear) and id(m) not in inside:
            found.setdefault(id(m), m)
    return list(found.values())


def _modules_outside(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules reachable from ``model`` without entering a block, by every path (a module shared
    by a block and by the model's own code is listed)."""
    skip = {id(b) for b in blocks}
    out, stack = [], [model]
    while stack:
        module = stack.pop()
        out.append(module)
        stack.extend(c for c in module.children() if id(c) not in skip)
    return out


def half_products_run_slowly(precision: str, model: nn.Module) -> bool:
    """Whether the model's matrix products run in bf16 or fp16 (``train.precision = bf16-mixed``, or such
    parameters) on a CPU whose ATen has no kernels for them: eagerly, they run in ATen's generic loop,
    30-70x slower than fp32 (``torch_private.cpu_has_half_gemm``)."""
    from accelrun.torch_private import cpu_has_half_gemm

    params = list(model.parameters())
    if not params or params[0].device.type != "cpu":
        return False
    half = {p.dtype for p in params} & {torch.bfloat16, torch.float16}
    if precision == "bf16-mixed":
        half.add(torch.bfloat16)
    return any(not cpu_has_half_gemm(dtype) for dtype in half)


def compile_model(model: nn.Module, blocks: list[nn.Module] | None, cfg: CompileConfig,
                  dump_dir: Path | None = None, loss_parallel: bool = False,
                  precision: str | None = None) -> Compiled:  # fmt: skip
    """Compile in place (``Module.compile`` keeps parameter names). ``precision``: the run's
    ``train.precision``, which with the model's parameters decides whether ``auto`` compiles a user's
    model for its half-precision products (its Linear layers outside the blocks too, or the whole
    model: ``resolve_scope``); None leaves that rule out."""
    from accelrun.models.build import FACTORY_COMPILED

    if cfg.backend == "eager":
        return Compiled("nothing (eager)" + ("; model.custom's factory returned torch.compile(model), which is "
                                             "undone: compile.backend=inductor compiles it as torch.compile does"
                                             if model in FACTORY_COMPILED else ""))  # fmt: skip
    backend: object = cfg.backend
    record = None
    if cfg.backend == "accelrun":
        from accelrun.compile.backend import AccelrunBackend
        from accelrun.compile.options import CompileOptions

        backend = AccelrunBackend(CompileOptions.from_config(cfg, dump_dir=dump_dir if cfg.dump else None))
        record = backend.record
    slow_half_products = precision is not None and half_products_run_slowly(precision, model)
    containers = None  # a user's `layers` of nn.ModuleDict / nn.ModuleList: read by the forward, never called
    if blocks and never_called(blocks[0]):
        containers, blocks = f"its `layers` hold {type(blocks[0]).__name__} containers, which the forward never calls", None
    scope, why = resolve_scope(cfg, model, blocks, loss_parallel, slow_half_products)
    if containers and cfg.scope == "auto":  # its layers are read, not called: the whole forward
        scope, why = "model", containers
    chosen = f" (compile.scope = auto: {scope}, {why})" if why else ""
    # auto's block scope for half products that run slowly eagerly: the Linears outside the blocks too
    # (an explicit compile.scope = block compiles the blocks alone; preflight warns about it)
    linears_wanted = cfg.scope == "auto" and cfg.backend == "accelrun" and slow_half_products
    eager_rnns = run_rnns_eagerly(model)  # without this, a frame that reads one compiled nothing

    undone = (f"; model.custom's factory returned torch.compile(model): the module inside is compiled with "
              f"{cfg.backend} instead" if model in FACTORY_COMPILED else "")  # fmt: skip

    def done(what: str) -> Compiled:
        return Compiled(what + chosen + described(eager_rnns) + undone, record, backend)

    name = cfg.backend
    found = None if blocks is not None or scope not in ("block", "loss") else repeated_blocks(model)
    if cfg.fullgraph and eager_rnns:
        units = blocks if blocks is not None else (found[1] if found is not None else None)
        _refuse_rnns_in_full_graphs(model, eager_rnns, units if scope in ("block", "loss") and units else [model])
    if scope in ("block", "loss") and (blocks is not None or found is not None):
        if blocks is not None:
            what, tail = f"{len(blocks)} transformer blocks with {name}", ""
        else:
            # A user's model without a `layers` list: compiling its forward whole would let one
            # data-dependent branch (a router) make Dynamo skip the frame, and nothing would be compiled.
            # Its repeated blocks compile on their own; the code between them runs eagerly.
            path, blocks = found
            what = f"{len(blocks)} repeated {type(blocks[0]).__name__} blocks ({path})"
            tail = f" with {name} (found among the model's modules)"
        head = getattr(model, "head_loss", None) if scope == "loss" else None
        if scope == "loss" and (head is None or not _has_head(model)):
            what += " (compile.scope = loss, but this model or stage computes no loss head)"
            head = None
        elif head is not None:
            what += " + the output head and loss as one graph"
        # (with a loss head graph, the head's product is in that graph already)
        linears = linears_outside(model, blocks) if linears_wanted and head is None else []
        targets = ([(b, "forward") for b in blocks] + ([(model, "head_loss")] if head is not None else [])
                   + [(m, "forward") for m in linears])  # fmt: skip
        cache = _graph_cache(cfg, backend, targets)
        _compile_each(blocks, backend, cache, fullgraph=cfg.fullgraph)
        what += _compile_linears(linears, backend, cache)
        if head is not None and cache is not None:
            from accelrun.compile.graph_cache import install

            install(cache, [model], "head_loss")
        elif head is not None:
            # An instance attribute shadows the method, so forward() calls the compiled head.
            model.head_loss = capturing_data_sized_outputs(
                torch.compile(head, backend=backend, fullgraph=cfg.fullgraph), backend, cfg.fullgraph)
        if record is not None and not _sharded_run():  # the blocks compiled nothing: no block ran
            _WholeForwardFallback(model, blocks, backend, record, cfg.fullgraph).install()
        return done(what + tail)
    if scope == "model" and (cache := _graph_cache(cfg, backend, [(model, "forward")])) is not None:
        from accelrun.compile.graph_cache import install

        # A model that is one of torch's own (a bare nn.Sequential) is traced from a frame of accelrun's,
        # as its blocks would be: precompiled on its own, the module reached the graph as an input.
        install(cache, [model], "forward", func=_class_forward if is_torch_builtin(type(model)) else None)
        _FirstCallFallback(model, backend, record).install("forward")  # a graph break: precompile refused
        return done(f"the whole model with {name}")
    compile_call(model, backend, cfg.fullgraph)
    if not cfg.fullgraph:
        _FirstCallFallback(model, backend, record).install(COMPILED_CALL)
    if scope != "model":
        return done(f"the whole model with {name} (compile.scope = {scope}, but it has no nn.ModuleList of "
                    "two or more blocks of one class with a forward of its own)")  # fmt: skip
    return done(f"the whole model with {name}")


def _refuse_rnns_in_full_graphs(model: nn.Module, rnns: list[EagerRnn], units: list[nn.Module]) -> None:
    """compile.fullgraph refuses every graph break, and an RNN inside a compiled module is one
    (eager_rnns.py): said before compiling, as a recipe error, instead of Dynamo's traceback at the
    first step naming accelrun's own ``torch.compiler.disable`` (a new user's trial)."""
    from accelrun.config import ConfigError

    inside = {id(m) for unit in units for m in unit.modules()}
    named = dict(model.named_modules())  # the RNNs themselves (get_submodule would find their stand-ins)
    hit = [r for r in rnns if id(named.get(r.name)) in inside]
    if hit:
        shown = ", ".join(f"{r.name} ({r.kind})" for r in hit[:3])
        raise ConfigError(f"compile.fullgraph = true, but {shown} inside the compiled code must run eagerly at a graph "
                          "break (torch.compile does not trace torch.nn's RNN, GRU and LSTM modules), which fullgraph "
                          "refuses; set compile.fullgraph=false: the code around it still compiles")


def is_torch_builtin(cls: type) -> bool:
    """A class whose forward is torch's own code: one of torch's (``nn.Linear``, ``nn.Sequential``), or a
    user's subclass that changes only how it is built (``class MyLayer(nn.TransformerEncoderLayer)``
    with an ``__init__`` of its own): Dynamo traces that code only when it is called from a frame it
    already traces. Precompiled on its own, such a subclass's module reached the graph where a tensor
    belonged ("native_layer_norm() Expected a value of type 'Tensor' ... found type 'MyLayer'")."""
    forward_module = getattr(getattr(cls, "forward", None), "__module__", None) or ""
    return any(name == "torch" or name.startswith("torch.") for name in (cls.__module__, forward_module))


def never_called(module: nn.Module) -> bool:
    """A module whose class has no forward of its own (``nn.ModuleDict``, ``nn.ModuleList``): a
    container the model's forward reads its modules from. Compiled as a block, it compiles nothing."""
    return type(module).forward is nn.Module.forward


def repeated_blocks(model: nn.Module, builtins: bool = False,
                    kinds: tuple[type[nn.Module], ...] = (nn.ModuleList,)) -> tuple[str, list[nn.Module]] | None:
    """(path, blocks): the outermost ``ModuleList`` (of ``kinds``) of at least two modules all of one class
    (a custom model's layers under another name; the experts inside a layer are deeper, so not taken), or
    None; of lists at one depth, the one holding the most parameters (a trial's two adapters declared before
    eight layers were compiled, the layers not). Lists of torch.nn's own modules count only with
    ``builtins`` (see the module's docstring)."""
    best: tuple[int, int, str, list[nn.Module]] | None = None  # (depth, -parameters, path, blocks)
    containers: list[str] = []  # lists of containers: a list inside one of them is one layer's, no blocks
    for path, module in model.named_modules():
        if not isinstance(module, kinds) or len(module) < 2 or len({type(m) for m in module}) != 1:
            continue
        if any(path.startswith(c + ".") for c in containers):
            continue
        if never_called(module[0]):  # a list of containers, or of a class with no forward
            containers.append(path)
            continue
        if is_torch_builtin(type(module[0])) and not builtins:
            continue
        rank = (path.count("."), -sum(p.numel() for p in module.parameters()))
        if best is None or rank < best[:2]:
            best = (*rank, path, list(module))
    return (best[2], best[3]) if best is not None else None


def checkpointed_blocks(part: nn.Module, blocks: list[nn.Module] | None) -> list[nn.Module] | None:
    """The blocks train.activation_checkpoint wraps: a built-in family's, else a user's model's repeated
    blocks as the compiler finds them (transformers' model.layers), then an ``nn.Sequential`` of them (a
    GPT written as one, refused before), then torch.nn's own (nn.TransformerEncoder's layers)."""
    if blocks is not None:
        return blocks
    hit = (repeated_blocks(part) or repeated_blocks(part, kinds=(nn.Sequential,))
           or repeated_blocks(part, builtins=True))
    return hit[1] if hit else None


def no_blocks_to_checkpoint(part: nn.Module) -> str:
    return ("train.activation_checkpoint needs a model with repeated blocks: an nn.ModuleList or nn.Sequential of "
            f"two or more modules of one class; {type(part).__name__} has none (train.activation_checkpoint.mode="
            "none trains it without)")


def compile_module(module: nn.Module, backend: object, fullgraph: bool = False) -> None:
    """``module.compile`` that also works for torch.nn's own modules: their forward is called from a
    frame of this file, which Dynamo traces, and inlined from there."""
    if not is_torch_builtin(type(module)):
        compile_call(module, backend, fullgraph)
        return
    # A forward the instance holds (activation checkpointing's wrapper) is kept, and called from the
    # compiled frame; replacing it with the class's would drop the checkpointing without a word.
    if "forward" in module.__dict__:
        module.__dict__[WRAPPED_FORWARD] = module.__dict__["forward"]
    # Bound to the module (not a closure over its forward): a deep copy of the model then calls its own
    # weights, the compiled function rebound to the copy.
    compiled = capturing_data_sized_outputs(torch.compile(_class_forward, backend=backend, fullgraph=fullgraph),
                                            backend, fullgraph)
    module.forward = types.MethodType(compiled, module)


WRAPPED_FORWARD = "_accelrun_wrapped_forward"  # a torch.nn module's own forward wrapper, under compile_module


def _class_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    wrapped = module.__dict__.get(WRAPPED_FORWARD)
    if wrapped is not None:
        return wrapped(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


class _FirstCallFallback:
    """After the whole model's first forward: the repeated modules inside it that ran outside every
    compiled graph compile one by one, so the run is not eager from start to end. Either Dynamo
    compiled nothing (it skipped the frame: a data-dependent branch in a loop; a mixture's experts),
    or a graph break inside torch.nn's code left the rest of that code to run eagerly (torch.nn's
    ``TransformerEncoder`` given a causal mask without ``is_causal=True`` reads the mask on the host:
    its layers then ran in no graph). The first step itself ran as it did.

    It wraps the callable that Module.__call__ reaches (``Module.compile``'s compiled call, or the graph
    cache's ``forward``) for one call, rather than adding a forward hook: hooks run inside the compiled
    call, and Dynamo breaks the graph at one that removes itself."""

    def __init__(self, model: nn.Module, backend: object, record: Any) -> None:
        from accelrun.compile.coverage import snapshot

        self.model, self.backend, self.record = model, backend, record
        self.start = snapshot()

    def install(self, attr: str) -> None:
        # A torch whose Module.compile keeps no ``COMPILED_CALL`` gets no fallback rather than a failed run.
        inner = getattr(self.model, attr, None)
        if inner is None:
            return

        def first_call(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            setattr(self.model, attr, inner)  # every later call goes straight to the compiled one
            self._after_first_forward()
            return out

        setattr(self.model, attr, first_call)

    def _after_first_forward(self) -> None:
        from accelrun.compile.coverage import since

        covered = since(self.start)
        compiled = covered["frames"].get("ok", 0) > 0 or (self.record is not None and self.record.graphs_in_use())
        if compiled and not (covered["graph_break"] and self.record is not None):
            return  # the forward compiled, whole or from the graph cache
        found = repeated_blocks(self.model, builtins=True)
        if found is None:
            return  # nothing smaller to try: the record's warning says nothing was compiled, and why
        path, blocks = found
        modules = f"{len(blocks)} {type(blocks[0]).__name__} modules of `{path}`"
        scope = f"Dynamo skipped the whole forward, so after the first step the {modules} compile one by one"
        if compiled:  # in pieces between graph breaks: unless no graph took any of the modules' weights
            if any(self._in_a_graph(b) for b in blocks):  # (identical ones share a graph: only one's are seen)
                return
            if isinstance(blocks[0], nn.RNNBase):
                return  # Dynamo traces no RNN module, on its own either (eager_rnns.py)
            scope = f"the {modules} ran outside every graph after a graph break, so after the first step they compile one by one"
        for block in blocks:
            compile_module(block, self.backend)
        if self.record is not None:
            self.record.fallback_scope = scope

    def _in_a_graph(self, module: nn.Module) -> bool:
        """Whether a compiled graph took ``module``'s weights as inputs. Assumed so for a module without
        weights, and for sharded ones (FSDP's DTensors: the graphs take the gathered tensors)."""
        params = list(module.parameters())
        if not params or any(_sharded(p) for p in params):
            return True
        return any(id(p) in self.record.parameters_in_graphs for p in params)


class _WholeForwardFallback:
    """After the first forward of a model whose blocks were compiled (``block``, ``loss``) by accelrun's
    backend on one rank: if no compiled graph ran and Dynamo compiled no frame, the blocks are not how
    the forward runs (it calls another of their methods, or reads modules out of them), and the whole
    forward compiles from the next forward, saying so. The first forward ran as it did. The wrapper is
    a plain function on the instance (a bound method of a local function made the loss head's
    precompile fail to save: "'LlamaForCausalLM' object has no attribute 'first_forward'"); a deep copy
    made before the first forward runs the original's (left: no caller here copies in that window)."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], backend: object, record: Any,
                 fullgraph: bool) -> None:  # fmt: skip
        from accelrun.compile.coverage import snapshot

        self.model, self.blocks, self.backend, self.record, self.fullgraph = model, blocks, backend, record, fullgraph
        self.start = snapshot()

    def install(self) -> None:
        model = self.model
        own = model.__dict__.get("forward")  # a forward the instance holds already (a loss head's)

        def first_call(*args: Any, **kwargs: Any) -> Any:
            # A forward that raises leaves this in place: the next one that returns decides.
            out = (own if own is not None else type(model).forward.__get__(model))(*args, **kwargs)
            if own is not None:
                model.forward = own
            else:
                model.__dict__.pop("forward", None)
            self._after_first_forward()
            return out

        model.forward = first_call

    def _after_first_forward(self) -> None:
        from accelrun.compile.coverage import since, skipped_frames

        if since(self.start)["frames"].get("ok", 0) > 0 or self.record.graphs_in_use():
            return
        if getattr(torch._dynamo.config, "disable", False):
            return  # compiling is off in this process (TORCH_COMPILE_DISABLE): nothing could have run
        block_type = type(self.blocks[0]) if self.blocks else None
        code = getattr(block_type.forward, "__code__", None) if block_type is not None else None
        why = next((reason for path, line, reason in skipped_frames(self.start)
                    if code is not None and (path, line) == (code.co_filename, code.co_firstlineno)), None)
        blocks = f"the {block_type.__name__} blocks" if block_type is not None else "the blocks"
        if why is None:
            said = (f"no compiled block ran in the first forward (a forward that calls another method of {blocks}, "
                    "or none of them)")
        else:
            # They ran, but Dynamo skipped their frame (a data-dependent branch in a loop over a mixture's
            # experts): said as it was (a trial read "no compiled block ran" of blocks that ran eagerly).
            # Their experts compiled one by one instead were no faster: 0.95x eager at dim 256, 0.61x at
            # 64 (each call's guards and dispatch against a few rows' products; 2026-12-07).
            said = f"Dynamo skipped {blocks}' forward ({why})"
        compile_call(self.model, self.backend, self.fullgraph)
        self.record.fallback_scope = f"{said}, so from the next one the whole forward compiles"


def _sharded_run() -> bool:
    """A multi-rank run: its model is laid out (sharded, split), and compiling it whole after the first
    step would be a layout nothing here tests (``dist/layout.py``)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _sharded(param: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def _compile_linears(linears: list[nn.Module], backend: object, cache: Any) -> str:
    """Compile each of ``linears`` (outside the blocks, where half-precision products run slowly
    eagerly) on its own, so that its product runs as an fp32 GEMM: through the graph cache where it is
    on, so a new process loads it (transformers' Llama in bf16, AVX2: first step 0.40 -> 0.22 s). Its
    first compile costs 0.6 s more than torch.compile's, once a process: AOTAutograd's cache key for a
    graph of ATen ops alone hashes Triton's and Inductor's sources. What was compiled, for the
    description."""
    _compile_each(linears, backend, cache)
    return f" + {len(linears)} nn.Linear layer{'s' if len(linears) != 1 else ''} outside them" if linears else ""


def _compile_each(modules: list[nn.Module], backend: object, cache: Any, fullgraph: bool = False) -> None:
    """Each module's forward through the graph cache (one with a graph break falls back to
    torch.compile there), or ``compile_module`` where it is off. Identical modules share one compiled
    graph: Dynamo's cache is keyed by code, not instance. torch.nn's own modules are traced from a frame
    of accelrun's either way (``_class_forward``): precompiled on their own, their module reached the
    graph where a tensor belonged."""
    if not modules:
        return
    if cache is None:
        for module in modules:
            compile_module(module, backend, fullgraph=fullgraph)
        return
    from accelrun.compile.graph_cache import install

    builtin = any(is_torch_builtin(type(m)) for m in modules)
    install(cache, list(modules), "forward", func=_class_forward if builtin else None)


def _graph_cache(cfg: CompileConfig, backend: object, targets: list[tuple[nn.Module, str]]):
    """accelrun's cross-process graph cache for these modules, or None (the reason goes in the record)."""
    if cfg.backend != "accelrun":
        return None
    from accelrun.compile.graph_cache import GraphCache, decline_reason

    why = decline_reason(cfg, targets)
    if why is not None:
        backend.record.graph_cache = {"off": why}  # type: ignore[attr-defined]
        return None
    return GraphCache(backend, backend.options.cache_dir / "graphs", fullgraph=cfg.fullgraph)  # type: ignore[attr-defined]


def _has_head(model) -> bool:
    """Whether this model or pipeline stage ends in its output layer (a family's model says so with
    ``has_head``; otherwise an ``output`` layer that a stage without the head sets to None)."""
    has = getattr(model, "has_head", None)
    return bool(has) if has is not None else getattr(model, "output", None) is not None

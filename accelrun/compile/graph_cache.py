"""Compiled graphs kept across processes, so that a new process skips Dynamo, AOTAutograd and the passes.

The kernel cache alone leaves a new process ~3 s of tracing before its first step. Here the first call
of a compiled method (a transformer block's ``forward``, the loss head) with a new kind of input is
captured with torch's precompile path (``torch.compile(...).aot_compile``): Dynamo's frame and guards,
AOTAutograd's forward and backward with their runtime metadata, and accelrun's graphs after its passes
(``AccelrunOutputCode``: the lowered graphs, their kernels by library path). It is saved under
``<cache>/graphs/<key>.pt``, after the digests of the files Dynamo traced for it; a later process
with the same key checks those files, loads it instead of compiling and checks its guards against
the real inputs.

The key covers what changes the compiled result and what the guards do not check: torch's version,
accelrun's own source and the model's, the compile options, the method, and the inputs, parameters
and global state (grad mode, autocast) it was compiled for. Identical blocks share one entry: the
guards check tensor metadata, not identity.

Anything the precompile path cannot take (a graph break, an unpicklable piece) falls back to an
ordinary ``torch.compile`` of the method, with the reason kept in the compile record.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import re
import tempfile
import time
import types
import warnings
import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import accelrun
from accelrun.compile import coverage
from accelrun.compile.activity import ACTIVITY
from accelrun.compile.break_sites import code_label
from accelrun.compile.codegen.cpp_build import scratch_folder
from accelrun.compile.eager_rnns import REASON as EAGER_RNN_REASON
from accelrun.compile.executors.generated import compiling_after
from accelrun.compile.gc_pause import gc_paused
from accelrun.compile.passes.base import first_sentence
from accelrun.compile.record import CompileRecord
from accelrun.compile.trace_settings import capturing_data_sized_outputs, side_effects_once
from accelrun.compile.traced_from import (
    BakedCheck,
    BakedValue,
    TracedFrom,
    baked_value,
    file_digest,
    readable,
)
from accelrun.log_filters import records_left_out
from accelrun.torch_private import (
    cpu_has_half_gemm,
    import_module_globals,
    module_hook_guards,
    modules_with_hooks,
)

MAX_ENTRIES = 8  # input kinds per method before giving up on exact entries (dynamic shapes take over)


@functools.cache
def accelrun_source_digest() -> str:
    """sha256 over accelrun's Python sources: a code change must not load graphs built by older code."""
    root = Path(accelrun.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def model_code_files(owner: nn.Module, func: Any) -> dict[str, str]:
    """The files ``model_code_digest`` covers, each with its sha256."""
    files = {inspect.getsourcefile(func)} | {inspect.getsourcefile(type(m)) for m in owner.modules()}
    for cls in {type(m) for m in owner.modules()}:
        files |= _wrapped_code(cls)[0]
    return {path: file_digest(path) for path in sorted(f for f in files if f)}


def model_code_digest(owner: nn.Module, func: Any, code: dict[str, str] | None = None) -> str:
    """sha256 over the files that define the compiled method and every module class under ``owner``,
    the functions their methods wrap and the plain values in those closures: models may live outside
    accelrun (``model.module``), and their code is traced into the graphs. Decorators count because
    the saved guards check neither the identity of their code nor their closures (``saveable_guards``):
    the digest stands for them. A closure's values are taken as they are when the model is compiled
    (a decorator's settings); one that changes later, within a process, is not seen. ``code``:
    ``model_code_files``'s, where the caller has it already."""
    closures: list[str] = []
    for cls in sorted({type(m) for m in owner.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        closures += _wrapped_code(cls)[1]
    h = hashlib.sha256()
    for path, digest in (code if code is not None else model_code_files(owner, func)).items():
        h.update(path.encode() + digest.encode())
    h.update(repr(closures).encode())
    return h.hexdigest()


_PLAIN = (type(None), bool, int, float, str, bytes)


@functools.cache
def _wrapped_code(cls: type) -> tuple[frozenset[str], tuple[str, ...]]:
    """Files of ``cls``'s methods (its own and inherited, torch's aside) and of the functions they wrap,
    and the plain values in those closures: decorators keep both in closure cells (transformers'
    ``merge_with_config_defaults`` around ``LlamaModel.forward``, ``deprecate_kwarg``'s names) or
    ``__wrapped__``."""
    files: set[str] = set()
    constants: list[str] = []
    seen: set[int] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("builtins", "torch"):
            continue
        for method in vars(klass).values():
            if not isinstance(method, types.FunctionType):
                continue
            for fn in (method, *wrapped_functions(method).values()):
                if id(fn) in seen:
                    continue
                seen.add(id(fn))
                files.add(fn.__code__.co_filename)
                values = _closure_values(fn)
                constants += [f"{fn.__qualname__}:{v!r}" for v in values if isinstance(v, _PLAIN)
                              or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v))]  # fmt: skip
                for v in values:
                    for item in v if isinstance(v, (tuple, list)) else (v,):
                        files |= _local_type_files(type(item))
    return frozenset(f for f in files if os.path.isfile(f)), tuple(constants)


_IMPORTED_AT = time.time()  # a traced file changed after this may differ from the code this process traced


def is_local_type(cls: type) -> bool:
    """A class made inside a function (or nested in one): Dynamo's rule for a type match it cannot save."""
    return cls.__qualname__ != cls.__name__


def _local_type_files(cls: type) -> set[str]:
    """Files of a locally made class's own methods (the `kernels` package's ``Func`` wrapper, which
    transformers' attention holds in a decorator's closure): the saved guards do not match its type
    (``saveable_guards``), so its code counts in the key instead."""
    if not is_local_type(cls):
        return set()
    own = [klass for klass in cls.__mro__ if klass.__module__.split(".")[0] not in ("builtins", "torch")]
    return {m.__code__.co_filename for klass in own for m in vars(klass).values() if isinstance(m, types.FunctionType)}


def wrapped_functions(func: Any) -> dict[str, types.FunctionType]:
    """The functions a decorated method wraps, by their place in its closures (``"1.0"``: cell 1 of
    ``func``, then cell 0 of that). A saved entry refers to them (Dynamo traced through them), and
    pickle finds a function by module and name, which leads to the decorator's wrapper instead:
    they travel as external data and are found again by place in the loading process."""
    found: dict[str, types.FunctionType] = {}
    todo: list[tuple[str, Any]] = [("", func)]
    while todo:
        place, fn = todo.pop(0)
        for i, inner in enumerate([*_closure_values(fn), getattr(fn, "__wrapped__", None)]):
            here = f"{place}.{i}".lstrip(".")
            if isinstance(inner, types.FunctionType) and all(inner is not f for f in found.values()):
                found[here] = inner
                todo.append((here, inner))
    return found


def _closure_values(fn: types.FunctionType) -> list[Any]:
    """What ``fn``'s closure cells hold (an empty cell, a name not yet assigned, is left out)."""
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            continue
    return values


def saveable_guards(entries: Sequence[Any], closure_names: frozenset[str] = frozenset(),
                    baked: list[BakedValue] | None = None) -> list[bool]:
    """Which of Dynamo's guards a graph-cache entry keeps (``torch.compile``'s ``guard_filter_fn``).

    What torch's precompile keeps by default (none of a kind it cannot save; on globals, only a plain
    constant), less three kinds that stand for the model's code, which the entry's key covers instead
    (``model_code_digest`` takes the files of decorated functions). What the graph baked in from
    globals and classes also goes into ``baked`` (``traced_from.BakedValue``), for the entry's record
    to check on load and at every call: torch's saved guards on them do not hold across processes, nor
    within one (``traced_from.BakedCheck``).

    - the identity of a code object: transformers' decorators read ``func.__code__.co_varnames``,
      and Dynamo guards that code object by identity, which precompile refuses to save;
    - values reached through the compiled method's own closure (``closure_names``: a decorator's
      settings and the function it wraps): precompile saves a function there as missing, and the
      loading process failed to rebuild the guards on it;
    - the class of an object whose class was made inside a function: precompile refuses to save a
      type match on it, and the loading process rebuilds the guards on a pickled copy of the inputs
      where such an object comes back as a bare ``nn.Module`` (its attributes kept, its class's
      methods gone), so what is read through ``type(object)`` is dropped too; guards on its
      attributes stay. transformers 5.25 with the `kernels` package (one of its requirements) wraps
      ``apply_rotary_pos_emb`` in such a class, and every new process traced the model again (3.2 s
      against eager's 0.13 s first step). The class's code is checked instead: held in a method's
      closure it is in the key (``_local_type_files``), and its file is among the files the entry
      was traced from (``TracedFrom``).

    Without them transformers' Llama compiled whole was never cached, and each new process traced it
    again (3.7 s against eager's 0.23 s first step)."""
    from accelrun.torch_private import CheckFunctionManager

    unsaveable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES

    def in_closure(name: str) -> bool:
        return any(name == c or name.startswith((c + ".", c + "[")) for c in closure_names)

    local_objects = {g.name for g in entries if is_local_type(type(g.value))}

    def on_local_class(g: Any) -> bool:  # the object's type, or anything read through ``type(object)``
        return ((g.name in local_objects and "TYPE_MATCH" in (g.guard_type, *g.derived_guard_types))
                or any(f"type({o})" in g.name for o in local_objects))  # fmt: skip

    def plain_constant(g: Any) -> bool:  # a global's plain value by a simple name, which torch's guards can hold
        return (g.guard_type == "CONSTANT_MATCH" and isinstance(g.value, (type(None), bool, int, float, str))
                and readable(g.name))  # fmt: skip

    mine = [in_closure(g.name) or on_local_class(g) or (isinstance(g.value, types.CodeType)
                                                         and "ID_MATCH" in g.derived_guard_types)
            for g in entries]  # fmt: skip
    keep = [not (m or (g.is_global and not plain_constant(g)) or g.guard_type in unsaveable)
            for g, m in zip(entries, mine, strict=True)]  # fmt: skip
    if baked is not None:
        baked += [v for g, m in zip(entries, mine, strict=True) if not m and (v := baked_value(g)) is not None]
    return keep


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"T({tuple(value.shape)},{value.stride()},{value.dtype},{value.device},"
                f"{value.requires_grad})")  # fmt: skip
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(describe(v) for v in value) + "]"
    return repr(value)


def module_settings(owner: nn.Module) -> str:
    """A digest of the plain settings (bools, numbers, strings) of ``owner`` and its submodules, which
    Dynamo's guards check but the key leaves out."""
    plain = (bool, int, float, str, type(None))
    settings = [(name, k, v) for name, m in owner.named_modules() for k, v in sorted(vars(m).items())
                if isinstance(v, plain)]  # fmt: skip
    return hashlib.sha256(repr(settings).encode()).hexdigest()[:16]


def global_state() -> dict[str, str]:
    """The global state Dynamo's guards check (its GlobalStateGuard): an entry compiled under other
    state is rejected on load. The thread count is part of it, and train.threads = auto picks it by
    the machine's load, so each thread count gets its own entry instead of recompiling over one."""
    autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
    matmul = torch.backends.cuda.matmul
    return {"grad": str(torch.is_grad_enabled()), "autocast": str(autocast),
            "default_dtype": str(torch.get_default_dtype()), "threads": str(torch.get_num_threads()),
            "deterministic": f"{torch.are_deterministic_algorithms_enabled()}"
                             f"/{torch.is_deterministic_algorithms_warn_only_enabled()}",
            "tf32": str(matmul.allow_tf32),
            "reduced_reductions": f"{matmul.allow_fp16_reduced_precision_reduction}"
                                  f"/{matmul.allow_bf16_reduced_precision_reduction}",
            # the cpu_half_gemm pass's choice: a cache shared by CPUs of two kinds keeps a graph for each
            "cpu_half_gemm": str([cpu_has_half_gemm(d) for d in (torch.bfloat16, torch.float16)])}


def state_changes(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs between the global state an entry was saved under and this process's, in words."""
    return [f"{_autocast_words(saved[k])}, not {_autocast_words(v)}" if k == "autocast" else f"{k} {saved[k]}, not {v}"
            for k, v in now.items() if k in saved and saved[k] != v]  # fmt: skip


_AUTOCAST_ENTRY = re.compile(r"\('(\w+)', (True|False), torch\.(\w+)\)")


def _autocast_words(value: str) -> str:
    """The saved autocast state as a user reads it, "autocast off" or "autocast cpu bfloat16", not the
    (device, enabled, dtype) tuples it is kept as."""
    on = [f"{device} {dtype}" for device, enabled, dtype in _AUTOCAST_ENTRY.findall(value) if enabled == "True"]
    return f"autocast {', '.join(on)}" if on else "autocast off"


@dataclass(frozen=True)
class EntryKey:
    """An entry's file name (code, inputs and global state), the same without the global state (entries
    of one method under other state share it), and that state."""

    full: str
    stateless: str
    state: dict[str, str]
    unversioned: str = ""  # the same without torch's and accelrun's versions and the compile options
    codeless: str = ""  # the same without the model's code either (entries of this method before an edit)
    code: dict[str, str] = field(default_factory=dict)  # the model's code files, by path, with their sha256


class GraphCache:
    """One per compiled model: the directory, the key's fixed parts, and what happened (for the record)."""

    def __init__(self, backend: Any, directory: Path, fullgraph: bool = False) -> None:
        # Import torch's precompile machinery now, with the model's setup, not inside the first step.
        import accelrun.compile.output_code  # noqa: F401
        from accelrun.torch_private import AOTCompiledFunction, GraphPickler  # noqa: F401

        self.backend = backend
        self.directory = directory
        # compile.fullgraph: a method whose precompile fails falls back to torch.compile with it too, so
        # a graph break still fails the run as it does with the cache off, instead of splitting quietly.
        self.fullgraph = fullgraph
        # What every key holds (in this order, as before they were named), kept apart too: a miss where
        # only these differ from a saved entry's says which (``note_version_change``).
        self.versions = {"torch": torch.__version__, "accelrun": accelrun_source_digest(),
                         "options": backend.options.fingerprint()}
        self.fixed_key = "|".join(self.versions.values())
        self.stats = backend.record.graph_cache
        # state_changed: why entries saved for this code were not loaded (global state, versions or options differ)
        self.stats.update({"loaded": 0, "compiled": 0, "saved": 0, "fallbacks": 0, "errors": [], "state_changed": [],
                           "rejected": 0})  # fmt: skip

    def key(self, func: Any, owner: nn.Module, args: tuple, kwargs: dict) -> EntryKey:
        params = sorted((n, describe(p)) for n, p in owner.named_parameters())
        buffers = sorted((n, describe(b)) for n, b in owner.named_buffers())
        code = model_code_files(owner, func)
        parts = [self.fixed_key, f"{func.__module__}.{func.__qualname__}", model_code_digest(owner, func, code),
                 describe(args), describe(sorted(kwargs.items())), repr(params), repr(buffers)]  # fmt: skip
        state = global_state()
        stateless = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
        full = hashlib.sha256("\n".join([*parts, repr(sorted(state.items()))]).encode()).hexdigest()[:32]
        unversioned = hashlib.sha256("\n".join(parts[1:]).encode()).hexdigest()[:32]
        codeless = hashlib.sha256("\n".join([parts[1], *parts[3:]]).encode()).hexdigest()[:32]
        return EntryKey(full, stateless, state, unversioned, codeless, code)

    def note_code_change(self, code_file: Path, now: dict[str, str]) -> None:
        """A miss where entries of this method were saved for other code of the model's own files: which
        changed (a comment's edit too), as an edit of a helper file is said (a trial's run compiled again
        after an edit of its model's file, without a word)."""
        try:
            saved = json.loads(code_file.read_text())
        except (OSError, ValueError):
            return
        changed = [Path(f).name for f, digest in now.items() if isinstance(saved, dict) and saved.get(f, digest) != digest]
        if changed:
            line = f"compiled again: {', '.join(changed)} changed since its graphs were saved"
            if line not in self.stats["errors"]:
                self.stats["errors"].append(line)

    def note_state_change(self, state_file: Path, now: dict[str, str]) -> None:
        """A miss where entries of the same code and inputs were saved under other global state (another
        thread count, most often): say so, naming the nearest saved state's differences, since the run
        compiles where the user expected a load."""
        self._note_nearest(state_file, now, state_changes)

    def note_version_change(self, versions_file: Path) -> None:
        """A miss where entries of the same model code and inputs were saved by another torch, another
        accelrun (an upgrade, or an edit of its source) or under other compile options: say which, as for
        a state (found by a new user: a run compiled again after accelrun's code changed, without a word)."""
        if self.versions not in saved_states(versions_file):
            self._note_nearest(versions_file, self.versions, version_changes)

    def _note_nearest(self, saved_file: Path, now: dict[str, str], changes: Any) -> None:
        """The differences (``changes(saved, now)``, in words) from the nearest of the settings saved in
        ``saved_file``, once per run in ``state_changed``."""
        nearest = min((found for saved in saved_states(saved_file) if (found := changes(saved, now))),
                      key=len, default=None)
        if nearest and (line := "; ".join(nearest)) not in self.stats["state_changed"]:
            self.stats["state_changed"].append(line)

    def remember_state(self, state_file: Path, state: dict[str, str]) -> None:
        """Add ``state`` to the states entries of this code and inputs were saved under (and, in the same
        way, the versions: ``remember_state(versions_file, cache.versions)``)."""
        states = saved_states(state_file)
        if state in states:
            return
        try:
            CachedMethod._write(state_file, json.dumps([*states, state]).encode())
        except OSError as e:  # only the reason for a later miss is lost: the entry itself is saved
            self.error(f"could not save {state_file.name}", e)

    def error(self, what: str, e: BaseException) -> None:
        self.stats["errors"].append(f"{what}: {failure_said(e)}")


def failure_said(e: BaseException) -> str:
    """A failure in one line for report.md and the refusal file: a graph break in the user's words."""
    return graph_break_said(e) or one_line(e)


def graph_break_said(e: BaseException) -> str | None:
    """A precompile's failure at a graph break (it traces with fullgraph) in the user's words, or None: Dynamo's
    own text ("Could not guard on data-dependent expression zuf0 > 10000.0") names torch's symbols, not the
    model's line, which the run's graph-break warning gives with what avoids it."""
    if not type(e).__module__.startswith("torch._dynamo"):
        return None
    text = str(e).strip()
    if "data-dependent expression" in text:
        what = "code that branches on a value read from a tensor"
    elif type(e).__name__ == "Unsupported":
        what = (text.splitlines() or ["?"])[0][:120]  # its title: "Data-dependent branching", ...
    else:
        return None
    return (f"the forward has a graph break ({what}), which cannot be saved; the graph-break warning says where"
            + ("" if EAGER_RNN_REASON in text else ", and what avoids it where something does"))


# How each part of ``GraphCache.versions`` reads when a saved entry's differs from this process's.
VERSION_WORDS = {"torch": "torch {saved}, not {now}",
                 "accelrun": "another version of accelrun's code (upgraded, switched or edited since)",
                 "options": "other compile options"}


def version_changes(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    return [VERSION_WORDS[k].format(saved=saved[k], now=v) for k, v in now.items() if k in saved and saved[k] != v]


def saved_states(state_file: Path) -> list[dict[str, str]]:
    """The global states saved beside entries of one method and input kind (``remember_state``)."""
    try:
        saved = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return []
    return [s for s in saved if isinstance(s, dict)] if isinstance(saved, list) else []


def _autograd_cache_quiet():
    """AOTAutograd's cache logs a warning where it cannot serialize a graph, then precompile raises the
    same error: a torch log line with a link on the user's console, beside accelrun's own line for it."""
    return records_left_out("torch._functorch._aot_autograd.autograd_cache", "unable to serialize")


# How a graph-cache error starts when a method could not be precompiled (a graph break, an untraceable
# module): the run's summary leaves these to report.md where its warnings already say why.
PRECOMPILE_FAILED = "precompile failed"


def one_line(e: BaseException) -> str:
    """The error's type and first line; a long line (torch's run on with advice and a link) to its first
    sentence, whole, rather than cut mid-word."""
    first = str(e).splitlines()[0] if str(e) else ""
    if len(first) > 160:
        first = first_sentence(first)
    said = f"{type(e).__name__}: {first}"
    return said if len(said) <= 300 else said[:299] + "…"


@dataclass
class HeldEntry:
    """A precompiled entry this process holds, and the values it baked in (``BakedCheck``)."""

    compiled: Any  # torch's AOTCompiledFunction
    baked: BakedCheck
    # Traced in this process, with capture_scalar_outputs on (``_compile``): its guards check that setting
    # (those of an entry loaded from a file do not).
    traced_here: bool = False

    def serves(self, method: CachedMethod, owner: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether this call may run it: torch's guards pass and the baked values read as traced, from the
        method's module as it is now. A value read through the owner alone (a class attribute through
        ``self``) needs no binding of the call's arguments (4 µs)."""
        compiled, owner_name = self.compiled, method.owner_name

        def f_locals() -> dict[str, Any]:
            if self.baked.arguments_read <= {owner_name}:
                return {owner_name: owner}
            return compiled.prepare_f_locals(owner, *args, **kwargs)

        if not self.traced_here:
            passed = compiled.guard_check(owner, *args, **kwargs)
        else:  # the setting as it was traced, for the check only (3.5 us)
            config = torch._dynamo.config
            before, config.capture_scalar_outputs = config.capture_scalar_outputs, True
            try:
                passed = compiled.guard_check(owner, *args, **kwargs)
            finally:
                config.capture_scalar_outputs = before
        return passed and self.baked.holds(method.live_globals, compiled.fn.__globals__, f_locals)


class CachedMethod:
    """Stands in for ``owner.<method>`` on every owner of one class; holds the compiled entries."""

    def __init__(self, cache: GraphCache, func: Any) -> None:
        self.cache, self.func = cache, func
        self.entries: list[HeldEntry] = []  # tried in order
        self.fallback: Any = None  # torch.compile of func, once precompiling failed
        self.owners: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every module this method stands in on
        self.hooked = False  # the fallback was for hooks: it runs with Dynamo's guards on them
        code = getattr(func, "__code__", None)
        # What the traced frame calls the owner, and the module globals it reads (live: the entry's own
        # are a copy taken when it was made, see traced_from.BakedCheck).
        self.owner_name = code.co_varnames[0] if code is not None and code.co_argcount else ""
        self.live_globals: dict[str, Any] = getattr(func, "__globals__", {})

    def bind(self, owner: nn.Module) -> Any:
        return functools.partial(self, owner)

    def __reduce__(self) -> tuple:
        # Dynamo pickles a module's attributes with a precompiled frame's guards, this (on the instance,
        # see ``install``) among them. What it holds is this process's (compiled entries, the backend):
        # pickled, the second kind of input a method met failed to precompile ("cannot pickle
        # RootGuardManager"). It is saved as a stand-in no guard reads.
        return (_stand_in, ())

    def __call__(self, owner: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.fallback is None:
            for entry in self.entries:
                if entry.serves(self, owner, args, kwargs):
                    return entry.compiled.fn(owner, *args, **kwargs)
            entry = self._entry_for(owner, args, kwargs)
            if entry is not None:
                return entry.compiled.fn(owner, *args, **kwargs)
        with module_hook_guards() if self.hooked else nullcontext():
            return self.fallback(owner, *args, **kwargs)

    def _entry_for(self, owner: nn.Module, args: tuple, kwargs: dict) -> HeldEntry | None:
        with gc_paused():  # Dynamo's trace and torch's load included
            return self._load_or_compile(owner, args, kwargs)

    def _load_or_compile(self, owner: nn.Module, args: tuple, kwargs: dict) -> HeldEntry | None:
        if len(self.entries) >= MAX_ENTRIES:
            return self._fall_back(f"more than {MAX_ENTRIES} kinds of input, or of values the graph baked in: "
                                   "this method goes on through torch.compile, uncached", None)
        if hooked := list(dict.fromkeys(p for o in (owner, *self.owners) for p in modules_with_hooks(o))):
            # Dynamo traces a called module's hooks into the graph and torch skips guards on hooks, so an
            # entry traced without one loaded (or, on another owner, was reused) and skipped it. Every
            # owner is checked: identical blocks share entries. torch.compile then guards on the hooks.
            self.hooked = True
            return self._fall_back(f"hooks on {', '.join(hooked[:3])} (the graph cache keys no hooks)", None)
        # Numbered by the kinds this method met before in this process, which a new process meets in
        # the same order: blocks whose traces differ per instance (sliding and full attention layers)
        # share a key, and one file each would have been overwritten by the other kind every run.
        key = self.cache.key(self.func, owner, args, kwargs)
        path = self.cache.directory / f"{key.full}-{len(self.entries)}.pt"
        state_file = self.cache.directory / f"{key.stateless}-{len(self.entries)}.state"
        refused = path.with_suffix(".refused")
        if refused.exists():  # an earlier process found this method cannot be precompiled: do not retry
            saved_settings, _, why = refused.read_text().partition("\n")
            # unless the modules' settings differ: the key leaves them to the guards (blocks that differ
            # only by their index share entries), and a model fixed through them (is_causal=True given
            # in model.kwargs) may precompile now.
            if saved_settings == module_settings(owner):
                return self._fall_back(f"{PRECOMPILE_FAILED} before: {why}", None)
        versions_file = self.cache.directory / f"{key.unversioned}-{len(self.entries)}.versions"
        code_file = self.cache.directory / f"{key.codeless}-{len(self.entries)}.code"
        held = variants_of(path)
        entry, rejections, unreadable, stale, edits = None, [], [], [], []
        for candidate in held:  # the most recently used first
            entry, rejected = self._load(candidate, owner, args, kwargs)
            if entry is not None:
                with contextlib.suppress(OSError):  # used: the last to be written over
                    os.utime(candidate)
                break
            if rejected is None:  # damaged: the first written over
                unreadable.append(candidate)
            elif isinstance(rejected, EditedSince):  # kept while a slot is free: an edit undone loads it again
                stale.append(candidate)
                edits.append(rejected.note)
            else:
                rejections.append(rejected)
        if entry is None and not held:
            self.cache.note_state_change(state_file, key.state)
            self.cache.note_version_change(versions_file)
            self.cache.note_code_change(code_file, key.code)
        if entry is None:
            # Said only when no entry held loads: the values another one was compiled for, the files edited
            # since (an edit undone loads the entry of before it, and nothing was compiled again).
            self.cache.stats["errors"] += edits
            self.cache.stats["rejected"] += len(rejections)
            for changed in rejections:
                if changed and changed not in self.cache.stats["state_changed"]:
                    self.cache.stats["state_changed"].append(changed)
            mark, counted = self.cache.backend.record.mark(), coverage.snapshot()
            try:
                with _autograd_cache_quiet():  # its "unable to serialize" is said below, once, as ours
                    compiled, traced, baked = self._compile(owner, args, kwargs)
            except Exception as e:  # graph break under fullgraph, an unserializable piece, ...
                self._write(refused, f"{module_settings(owner)}\n{failure_said(e)}".encode())
                # Its graphs never run and its graph breaks are the fallback's: those are counted.
                self.cache.backend.record.roll_back(mark)
                coverage.forget_since(counted)
                return self._fall_back(f"{PRECOMPILE_FAILED} (nothing saved: each new process compiles it again)", e)
            if self._save(compiled, traced, baked, slot_for(path, held, unreadable, stale)):
                self.cache.remember_state(state_file, key.state)
                self.cache.remember_state(versions_file, self.cache.versions)
                with contextlib.suppress(OSError):  # only what note_code_change reads: a miss says less without it
                    self._write(code_file, json.dumps(key.code).encode())
            entry = HeldEntry(compiled, BakedCheck(tuple(baked)), traced_here=True)
        self.entries.append(entry)
        return entry

    def _load(self, path: Path, owner: nn.Module, args: tuple, kwargs: dict
              ) -> tuple[HeldEntry | None, str | EditedSince | None]:
        """The entry saved at ``path`` if it serves this call; else None and, where it was rejected, why
        ("" when the reason is not one to say: guards on what the key does not cover)."""
        from accelrun.compile.codegen.cached_files import kernel_files_under
        from accelrun.compile.output_code import recording_loads_into
        from accelrun.torch_private import AOTCompiledFunction

        record = self.cache.backend.record
        # What loading lowers and replays goes into a record of its own, kept only if the entry is used:
        # a rejected entry is compiled afresh, and both would otherwise be counted (regions, graphs, ops).
        loading = CompileRecord(cuda_graphs=record.cuda_graphs)
        t0 = time.perf_counter()
        try:
            sources, data = TracedFrom.split(path.read_bytes())
            if changed := sources.changed_file():  # expected after an edit: said as what it is, not a failure
                return None, EditedSince(f"{path.name} compiled again: {changed} changed since it was compiled")
            with recording_loads_into(loading), kernel_files_under(self.cache.directory.parent):
                entry = AOTCompiledFunction.deserialize(data, self.func.__globals__,
                                                        external_closure_data=wrapped_functions(self.func))
            if changed := sources.changed_value(entry.fn.__globals__, entry.prepare_f_locals(owner, *args, **kwargs)):
                return None, changed  # a setting of the model's modules, not an error: compiled for this value
            if not entry.guard_check(owner, *args, **kwargs):
                # Saved for what its key does not cover (a module attribute the forward branches on, as
                # two runs of one model with other model.kwargs): a miss, not an error to print.
                return None, ""
            held = HeldEntry(entry, BakedCheck(sources.values))
        except Exception as e:  # stale or damaged: compile afresh and overwrite it
            self.cache.error(f"could not load {path.name}", e)
            return None, None
        record.absorb(loading)
        self.cache.stats["loaded"] += 1
        record.stage_seconds["graph cache load"] += time.perf_counter() - t0
        return held, None

    def _compile(self, owner: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, set[str], list[BakedValue]]:
        """The precompiled entry, and what it was traced from (``TracedFrom``): the files Dynamo traced
        for it, and the values it baked in from globals and classes that read back as they were."""
        from accelrun.torch_private import (
            files_traced_by_precompile,
            temporary_cache_dir,
            unread_compile_logs_skipped,
        )

        backend = self.cache.backend
        try:  # a head start only: its failure must not mark the method as refused
            backend.before_tracing(owner)
        except Exception as e:  # noqa: BLE001 (can't start a thread, ...): the pass starts the build later
            self.cache.error("could not start the early kernel build", e)
        # torch 2.11 leaves ``aot_compile`` off by default (2.13 has it on): without it every graph was
        # refused ("'function' object has no attribute 'aot_compile'"), and an H200's new process compiled
        # everything again (warm start 6.7 s against Inductor's 1.4 s, 2026-11-27).
        config = torch._dynamo.config
        with config.patch(enable_aot_compile=True) if hasattr(config, "enable_aot_compile") else nullcontext():
            baked: list[BakedValue] = []
            compiled = torch.compile(self.func.__get__(owner), backend=backend, fullgraph=True,
                                     options={"guard_filter_fn": functools.partial(
                                         saveable_guards, closure_names=frozenset(self.func.__code__.co_freevars),
                                         baked=baked)})  # fmt: skip
        # torch's own caches during precompile go to a throwaway folder: their keys do not cover
        # accelrun's options, so an entry left there by other options must never be found.
        with (tempfile.TemporaryDirectory(prefix="accelrun-precompile-") as tmp, temporary_cache_dir(tmp),
              warnings.catch_warnings()):  # fmt: skip
            # Dynamo reads every tensor's .grad while it writes the guards down; harmless, but it warns.
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            backend.serializable = True
            # (torch.nn's own modules are traced from a frame of accelrun's compiler: named by their class)
            backend.precompiling = (f"{type(owner).__name__}.forward (torch.nn)"
                                    if self.func.__module__.startswith("accelrun.compile.")
                                    else code_label(self.func.__code__))  # fmt: skip
            stages = backend.record.stage_seconds
            timed_before, t0 = sum(stages.values()), time.perf_counter()
            try:
                with (files_traced_by_precompile() as traced, unread_compile_logs_skipped(),
                      compiling_after(len(self.entries)),  # the kinds of input this method met before
                      ACTIVITY.compiling(f"Dynamo traces {type(owner).__name__}.{self.func.__name__}"),
                      # what Dynamo does under fullgraph anyway, said so that a model's code can tell a
                      # whole-graph trace (torch_private.traces_host_reads: a mixture of experts' counts)
                      config.patch(capture_scalar_outputs=True, **side_effects_once())):
                    entry = compiled.aot_compile((args, kwargs))
            finally:
                backend.serializable, backend.precompiling = False, ""
            # The rest of the precompile's wall time is Dynamo's (tracing the bytecode, writing guards):
            # timed here, a compile time need not be guessed from the first step.
            stages["dynamo trace"] += max(time.perf_counter() - t0 - (sum(stages.values()) - timed_before), 0.0)
        self.cache.stats["compiled"] += 1
        # What cannot be read back where it was traced would make every later process reject the entry.
        # Only a check: should it fail, the entry is saved with no values rather than refused.
        try:
            f_locals = entry.prepare_f_locals(owner, *args, **kwargs)
            baked = [v for v in baked if v.holds_in(entry.fn.__globals__, f_locals)]
        except Exception as e:  # noqa: BLE001 (torch's frame binding, a user's __eq__: never a refusal)
            self.cache.error("could not read back the values the graph baked in (saved without them)", e)
            baked = []
        return entry, traced, baked

    def _save(self, entry: Any, traced: set[str], baked: list[BakedValue], path: Path) -> bool:
        try:
            import_module_globals(entry)
            data = type(entry).serialize(entry, external_data=wrapped_functions(self.func)).serialized_data
            if (missing := self._kernels_never_cached(data)) is not None:
                self.cache.stats["errors"].append(f"not saved: {missing}")
                return False
            self._write(path, TracedFrom.of(traced, tuple(baked), imported_at=_IMPORTED_AT).with_entry(data))
            self.cache.stats["saved"] += 1
            return True
        except Exception as e:  # kept in memory for this process; the next one compiles again
            self.cache.error(f"could not save {path.name}", e)
            return False

    def _kernels_never_cached(self, data: bytes) -> str | None:
        """Why a kernel library the entry names will not be in the cache for a later process, or None: its
        build failed, or the kernel cache could not be written (built in a folder this process removes at
        its end). Saved, such an entry sent every later process to load, miss and compile again. (One still
        building is fine: the cache finds it done.)"""
        from accelrun.compile.codegen.cpp_build import failure_path

        kernels = self.cache.directory.parent / "cpp"
        named = set(re.findall(re.escape(f"{kernels}{os.sep}".encode()) + rb"([0-9a-f]{64})\.so", data))
        for key in sorted(named):
            library = kernels / f"{key.decode()}.so"
            if library.exists():
                continue
            if failure_path(library).exists():
                return f"its kernel library {library.name} failed to build"
            if (scratch := scratch_folder()) is not None:
                return f"its kernels could not be written into {kernels} (built in {scratch} for this process only)"
        return None

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one

    def _fall_back(self, why: str, e: BaseException | None) -> None:
        if e is not None:
            self.cache.error(why, e)
        else:
            self.cache.stats["errors"].append(why[:300])
        self.cache.stats["fallbacks"] += 1
        self.fallback = capturing_data_sized_outputs(
            torch.compile(self.func, backend=self.cache.backend, fullgraph=self.cache.fullgraph), self.cache.backend,
            self.cache.fullgraph)
        return None


@dataclass(frozen=True)
class EditedSince:
    """``_load``'s rejection of an entry traced from a file that has changed since (kept apart from a
    damaged one's), with the line a miss says."""

    note: str


# Entries kept for one key and input kind, compiled for values the key does not cover (a module attribute,
# a global the forward reads): two that alternate between processes (`accelrun ab` of two dropout rates)
# each load, instead of each process writing over the other's entry and compiling again.
MAX_VARIANTS = 4


def variants_of(path: Path) -> list[Path]:
    """The entries held for ``path``'s key and input kind (``K-0.pt``, ``K-0.v2.pt``, ...), the most
    recently used first."""
    found: list[tuple[int, Path]] = []
    for n in range(1, MAX_VARIANTS + 1):
        try:  # one stat: another process may replace the file meanwhile (never remove it: os.replace)
            found.append((variant_path(path, n).stat().st_mtime_ns, variant_path(path, n)))
        except OSError:
            continue
    return [p for _, p in sorted(found, key=lambda t: t[0], reverse=True)]


def variant_path(path: Path, n: int) -> Path:
    return path if n == 1 else path.with_name(f"{path.stem}.v{n}{path.suffix}")


def slot_for(path: Path, held: list[Path], unreadable: Sequence[Path] = (), stale: Sequence[Path] = ()) -> Path:
    """Where a newly compiled entry goes: over an entry that could not be read (damaged), else the first
    free slot, else over one traced from a file that has changed since (the least recently used of them),
    else over the least recently used entry. An entry of an edited file is kept while there is room: an
    edit undone loads it again (a trial's revert compiled again, the edited version's entry written over
    the original). Written over, not removed: another process may have just replaced the file."""
    if unreadable:
        return unreadable[0]
    free = [variant_path(path, n) for n in range(1, MAX_VARIANTS + 1) if variant_path(path, n) not in held]
    return free[0] if free else stale[-1] if stale else held[-1]


def _stand_in() -> Any:
    return _detached


def _detached(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("a graph-cache method unpickled from a saved entry's guards is not callable")


def _wrapped_by(wrapper: Any) -> str:
    """What replaced a module's method on the instance, as far as it can be told."""
    from accelrun.dist.activation_checkpoint import is_checkpointed

    if is_checkpointed(wrapper):
        return "checkpointed (train.activation_checkpoint): a checkpointed block is compiled afresh"
    return "replaced on the instance (not the class's method): compiled afresh"


def decline_reason(cfg: Any, targets: list[tuple[nn.Module, str]]) -> str | None:
    """Why these (module, method) pairs cannot go through the graph cache, or None."""
    if not cfg.graph_cache:
        return "compile.graph_cache = false"
    if cfg.dump:
        return "compile.dump writes every pass's graphs, so graphs are compiled afresh"
    if cfg.debug_numerics:
        return "compile.debug_numerics reruns every pass, so graphs are compiled afresh"
    if cfg.strict:  # a loaded graph's fallbacks happened where no strict run could see them
        return "compile.strict checks every pass and region as they compile, so graphs are compiled afresh"
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "multi-rank runs compile afresh (sharded parameters and collectives are not cached)"
    from accelrun.dist.activation_checkpoint import is_checkpointed

    for owner, method in targets:
        if (unfiled := code_without_a_file(owner)) is not None:
            return unfiled
        if method in owner.__dict__ and method not in instance_methods(owner):
            return f"{type(owner).__name__}.{method} is {_wrapped_by(owner.__dict__[method])}"
        # a block inside it checkpointed (a whole model compiled over an nn.Sequential of checkpointed
        # blocks): the key does not say which blocks are, so an entry could serve a run that checkpoints none
        if method == "forward" and (inner := next(  # (another method, a loss head, calls no block)
                (m for m in owner.modules() if m is not owner and is_checkpointed(m.__dict__.get("forward"))), None)):
            return (f"{type(inner).__name__}.forward inside {type(owner).__name__} is checkpointed "
                    "(train.activation_checkpoint)")
        # The model says why its whole forward may not (its other methods, a loss head, still may).
        if method == "forward" and (why := getattr(owner, "graph_cache_declines_forward", None)) is not None:
            return why
    return None


def code_without_a_file(owner: nn.Module) -> str | None:
    """Why the key cannot cover ``owner``'s code, or None: a module class defined where no source file
    holds it (typed into ``python -`` or a REPL), which the key reads to tell an edited model from the
    one an entry was compiled for (it raised, and the first step with it)."""
    for cls in sorted({type(m) for m in owner.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        try:
            path = inspect.getsourcefile(cls)
        except (TypeError, OSError):  # its module has no file at all (``__main__`` of ``python -c``)
            where = f"in module {cls.__module__}, which has no file"
        else:  # None: a compiled extension's class (no Python source; the key leaves it out, as before)
            if path is None or os.path.isfile(path):
                continue
            where = f"in {path}"
        return f"{cls.__qualname__} is defined {where}: its graphs are compiled afresh in each process"
    return None


def instance_methods(owner: nn.Module) -> dict[str, Any]:
    """The functions accelrun put on this instance in place of its class's methods, by name
    (``models.causal_lm_head``): compiled as the owner's method, and no wrapper of a user's."""
    return getattr(owner, "accelrun_methods", {})


def install(cache: GraphCache, owners: list[nn.Module], method: str, func: Any = None) -> None:
    """Route ``owner.<method>`` of every owner through one CachedMethod per class. ``func``: what is
    traced in place of the class's method, called with the owner first (a function of accelrun's
    own that calls it: Dynamo traces torch.nn's own code only when called from a frame it traces)."""
    shared: dict[type, CachedMethod] = {}
    for owner in owners:
        cls = type(owner)
        if cls not in shared:
            shared[cls] = CachedMethod(cache, func or instance_methods(owner).get(method) or getattr(cls, method))
        shared[cls].owners.add(owner)
        # An instance attribute shadows the class's method, so Module.__call__ reaches the cached one.
        setattr(owner, method, shared[cls].bind(owner))

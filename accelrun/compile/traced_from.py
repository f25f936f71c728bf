"""What a graph-cache entry was traced from that neither its key nor torch's saved guards check across
processes, written in the entry's file ahead of it and checked before it loads (``TracedFrom``), the
values also at every call of an entry the process holds (``BakedCheck``):

- the sha256 of each file Dynamo traced for it (``files_traced_by_precompile``). The key covers the
  model's classes and the functions their methods wrap, but not a helper a forward calls from another
  file: edited, its old graph loaded and trained on (``x * 2`` edited to ``x * 3`` gave ``x * 2``'s
  result). torch's files are left out (its version is in the key) and so are accelrun's (its sources
  are); so is code with no file (a dataclass's generated ``__init__``, ``exec``).
- the values the graph baked in from module globals (``G['SCALE']``, ``G['__import_mylib'].BOOST``,
  ``G['SETTINGS']['scale']``, a tuple's length, a dict's keys, a dtype, an enum member, a function
  chosen at import) and from classes (``dict(type(self).__dict__)['SCALE']``, a base class's through
  ``__mro__``): ``BakedValue``, one per guard Dynamo wrote on them. torch's precompile drops guards on
  globals, and rebuilds a loaded entry's guards on what it reads through a module or a class against
  that module or class as it is now, so they always passed: a setting a module reads from the
  environment at import, or one a script sets on a class, changed, and the graph compiled for the old
  value was loaded (a helper's ``* 3`` trained with ``* 2``'s graph: 22.96 against eager's 34.43).
"""

from __future__ import annotations

import collections
import enum
import functools
import hashlib
import json
import keyword
import math
import os
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import accelrun

# A guard's name for a module global or an argument (``G['CFG']``, ``self``), then attributes and
# constant subscripts (``.mult``, ``['scale']``, ``[0]``); or a class's own attribute, read through
# the type of such a path or one of its bases (``dict(type(self).__mro__[1].__dict__)['SCALE']``).
_PATH = r"(?:G\['[^']+'\]|[A-Za-z_]\w*)(?:\.[A-Za-z_]\w*|\['[^']*'\]|\[-?\d+\])*"
_PATH_NAME = re.compile(_PATH)
_PATH_STEP = re.compile(r"G\['([^']+)'\]|^([A-Za-z_]\w*)|\.([A-Za-z_]\w*)|\['([^']*)'\]|\[(-?\d+)\]")
_CLASS_ATTRIBUTE = re.compile(rf"dict\(type\(({_PATH})\)(?:\.__mro__\[(\d+)\])?\.__dict__\)\['(\w+)'\]")
_UNREADABLE = object()

# How a guard reads what it checks, by Dynamo's guard type: the value itself, its length, its keys.
_VALUE_GUARDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "ID_MATCH", "CLOSURE_MATCH", "BUILTIN_MATCH",
                           "FUNCTION_MATCH"})  # fmt: skip
_LENGTH_GUARDS = frozenset({"SEQUENCE_LENGTH", "LENGTH_CHECK"})
_KEYS_GUARDS = frozenset({"DICT_KEYS_MATCH", "DICT_KEYS"})
_TYPE_GUARDS = frozenset({"TYPE_MATCH"})
_PLAIN = (type(None), bool, int, float, str)  # what JSON holds as it is


def fingerprint(value: Any) -> Any:
    """``value`` as the record keeps it (JSON, the same in every process that has the same value), or
    ``_UNREADABLE`` for a value it cannot hold (an object's identity, a tensor)."""
    if isinstance(value, enum.Enum):  # before the plain types: a str enum is a str (kernels' Action)
        return f"enum {type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if type(value) in _PLAIN:
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return f"torch {value}"
    if isinstance(value, types.FunctionType):  # by its code too: two lambdas share a qualified name
        code = value.__code__
        return f"function {value.__module__}.{value.__qualname__}:{code.co_firstlineno}:{_code_digest(code)}"
    if isinstance(value, types.BuiltinFunctionType):
        return f"function {getattr(value, '__module__', None)}.{value.__qualname__}"
    if isinstance(value, type):
        return f"type {value.__module__}.{value.__qualname__}"
    if isinstance(value, tuple) and all(type(v) in _PLAIN for v in value):
        return list(value)
    return _UNREADABLE


def _code_digest(code: types.CodeType) -> str:
    """A digest of a function's code that is the same in every process: its bytecode and constants,
    nested code by its own digest (a code object's repr holds its address)."""
    return hashlib.sha256(code.co_code + _canonical(code.co_consts).encode()).hexdigest()[:12]


def _canonical(const: Any) -> str:
    """A constant's text, the same in every process: nested code by digest, a frozenset's members sorted
    (their order follows the process's string hashing)."""
    if isinstance(const, types.CodeType):
        return _code_digest(const)
    if isinstance(const, tuple):
        return "(" + ",".join(_canonical(c) for c in const) + ")"
    if isinstance(const, frozenset):
        return "frozenset(" + ",".join(sorted(_canonical(c) for c in const)) + ")"
    return repr(const)


@dataclass(frozen=True)
class BakedValue:
    """One value a graph read from a module global or a class, by the name of Dynamo's guard on it."""

    name: str
    kind: str  # "value" | "len" | "keys" | "type": what of it the guard checks
    value: Any  # JSON: a fingerprint, a length, a list of keys

    def now(self, scope: dict[str, Any], f_locals: dict[str, Any]) -> Any:
        """What the guard reads now, as the record keeps it, or ``_UNREADABLE``."""
        return self.as_kept(guarded_value(self.name, scope, f_locals))

    def as_kept(self, value: Any) -> Any:
        """``value`` (what the guard's name reads) as the record keeps it: its fingerprint, length, keys
        or type; ``_UNREADABLE`` where it has none."""
        if value is _UNREADABLE:
            return value
        try:
            if self.kind == "type":
                return fingerprint(type(value))
            if self.kind == "len":
                return len(value)
            if self.kind == "keys":  # as a sorted list: a dict built from a set orders its keys per process
                keys = sorted(value.keys(), key=repr)
                return keys if all(type(k) in _PLAIN for k in keys) else _UNREADABLE
        except (AttributeError, TypeError):
            return _UNREADABLE
        return fingerprint(value)

    def reads_as(self, expected: Any, now: Any, scope: dict[str, Any], f_locals: dict[str, Any]) -> bool:
        """Whether ``now`` (as kept) is ``expected``; one that cannot be read where its global or argument
        is gone is let pass (a name Dynamo gave its own helpers in the tracing frame, which a loading
        frame need not have; a user's global that is gone is an edit of a traced file, which
        ``TracedFrom.changed_file`` finds)."""
        if now is _UNREADABLE and not root_present(self.name, scope, f_locals):
            return True
        return same(now, expected)

    def holds_in(self, scope: dict[str, Any], f_locals: dict[str, Any]) -> bool:
        """Whether it reads back as the entry's file will keep it (through JSON): where it was traced, one
        that does not would make every later process reject the entry."""
        return same(self.now(scope, f_locals), json.loads(json.dumps(self.value)))

    def said(self, now: Any) -> str:
        """``userpkg.helpers.SCALE = 2.0 (3.0 now)``: the value the graphs hold, and this process's."""
        what = {"len": f"len({said_name(self.name)})", "keys": f"the keys of {said_name(self.name)}",
                "type": f"type({said_name(self.name)})"}.get(self.kind, said_name(self.name))
        return f"{what} = {self.value!r} ({'unreadable' if now is _UNREADABLE else repr(now)} now)"


class BakedCheck:
    """Whether the values one entry baked in still read as traced: checked at each of the entry's calls
    in this process, as Dynamo's guards on them would have been. torch's precompile drops those guards
    in the process that compiled the entry too, so a script that set a global tuple or dtype its model
    reads went on running the graph traced for the old one (found 2026-12-07: 91.8 where eager gave
    137.7), where ``torch.compile`` without the graph cache compiles again.

    A global is read from the module's own globals (``live``) where it is one: the entry's function
    runs with a copy of them taken when the entry was made (torch 2.13's ``forward_callable``), in
    which a global the script set since still holds the old value; Dynamo's own names for imported
    modules (``__import_torch``) are in the copy alone.

    A call first runs one generated expression, as Dynamo's guards are code: each value is the same
    object as at the last call that checked it in full (a length and a dict's keys are read anew, as a
    list or dict may change in place; a type, as the object's class). Where that fails, each value is
    read and compared as the entry records it (``changed_value``), and the objects read are kept for the
    next call. A transformers Llama layer bakes in 38 values (torch's and transformers' functions,
    mostly): 18 µs a call read one by one, 3.5 µs as the expression."""

    def __init__(self, values: tuple[BakedValue, ...]) -> None:
        self.values = values
        self.expected = [json.loads(json.dumps(v.value)) for v in values]  # as the entry's file keeps it
        self.last: list[Any] = [_UNREADABLE] * len(values)
        self.arguments_read = frozenset(name for v in values if (name := argument_read(v.name)) is not None)
        try:
            self._same_objects = _same_objects_expression(values)
        except Exception:  # noqa: BLE001 (a damaged record: an index too long, a name no expression holds)
            self._same_objects = _never
        self.full_checks = 0  # calls that read the values one by one (the expression failed)

    def holds(self, live: dict[str, Any], entry_globals: dict[str, Any], f_locals: Callable[[], dict[str, Any]]) -> bool:
        """Whether every value reads as traced, from the module's globals (``live``), Dynamo's names in the
        entry's own (``entry_globals``) and, only where a value is read through them, the call's arguments.
        One that cannot be read is let pass where its root is gone, as in ``changed_value``; a value whose
        reading raises anything is one that changed."""
        if not self.values:
            return True
        frame_locals = f_locals() if self.arguments_read else {}
        try:
            if self._same_objects(live, entry_globals, frame_locals, self.last, self.expected):
                return True
        except Exception:  # noqa: BLE001 (a value gone, a user's property or __eq__): read one by one below
            pass
        self.full_checks += 1
        scope = collections.ChainMap(live, entry_globals)
        for i, baked in enumerate(self.values):
            try:
                value = guarded_value(baked.name, scope, frame_locals)
                if not baked.reads_as(self.expected[i], baked.as_kept(value), scope, frame_locals):
                    return False
            except Exception:  # noqa: BLE001 (a user's property that raises): not the value traced
                return False
            self.last[i] = type(value) if baked.kind == "type" else value
        return True


def _same_objects_expression(values: tuple[BakedValue, ...]) -> Callable[..., bool]:
    """``fn(LG, G, L, last, expected)``: True when each value is ``last[i]`` (a type: the value's class is;
    a length or a dict's keys: equal to ``expected[i]``). Globals are read from ``LG`` where they are
    there, else from ``G``. The names were parsed by ``_parsed`` (identifiers, quoted keys, integers);
    an attribute that is no plain identifier is read with ``getattr``. A name ``_parsed`` refuses makes
    one that is always False (the values are then read one by one)."""
    terms = []
    for i, baked in enumerate(values):
        parsed = _parsed(baked.name)
        if parsed is None:
            return _never
        steps, mro_index, attribute = parsed
        read = _path_expression(steps)
        if attribute is not None:
            read = f"vars(type({read}).__mro__[{mro_index}])[{attribute!r}]"
        if baked.kind == "len":
            terms.append(f"len({read}) == expected[{i}]")
        elif baked.kind == "keys":
            terms.append(f"sorted({read}.keys(), key=repr) == expected[{i}]")
        elif baked.kind == "type":
            terms.append(f"type({read}) is last[{i}]")
        else:
            terms.append(f"{read} is last[{i}]")
    source = f"def same_objects(LG, G, L, last, expected):\n    return {' and '.join(terms) or 'True'}\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "<accelrun baked values>", "exec"), namespace)  # BakedCheck catches what fails
    return namespace["same_objects"]


def _never(*_: Any) -> bool:
    return False


def _path_expression(steps: tuple[tuple[str, ...], ...]) -> str:
    read = ""
    for global_name, local, attr, key, index in steps:
        if global_name:
            read = f"(LG[{global_name!r}] if {global_name!r} in LG else G[{global_name!r}])"
        elif local:
            read = f"L[{local!r}]"
        elif attr:
            read = f"{read}.{attr}" if attr.isidentifier() and not keyword.iskeyword(attr) else f"getattr({read}, {attr!r})"
        else:
            read = f"{read}[{key!r}]" if not index else f"{read}[{int(index)}]"
    return read


def baked_value(guard: Any) -> BakedValue | None:
    """The ``BakedValue`` a guard Dynamo wrote stands for, or None: a guard on something else (an
    input, the model's own attributes, which torch's saved guards check), or one the record cannot
    read back by its name or hold (an object's identity)."""
    if not (guard.is_global or guard.name.startswith("dict(type(") or _function_by_identity(guard)) \
            or not readable(guard.name):
        return None
    if guard.name.startswith("G['__builtins"):  # Dynamo's own name for the builtins, not in a loading frame
        return None
    if "._dynamo.config." in guard.name:  # a setting accelrun patches while it traces (traces_host_reads),
        return None  # read back at a call outside that patch: never a value the model baked in
    types_ = {guard.guard_type, *guard.derived_guard_types}
    if types_ & _LENGTH_GUARDS:
        kind, value = "len", len(guard.value) if hasattr(guard.value, "__len__") else _UNREADABLE
    elif types_ & _KEYS_GUARDS and isinstance(guard.value, dict):
        kind, value = "keys", sorted(guard.value.keys(), key=repr)
    elif types_ & _VALUE_GUARDS and not isinstance(guard.value, types.ModuleType):
        kind, value = "value", fingerprint(guard.value)
    elif types_ & _TYPE_GUARDS and guard.is_global and not isinstance(guard.value, types.ModuleType):
        kind, value = "type", fingerprint(type(guard.value))  # a global whose class is chosen at import
    else:
        return None
    if value is _UNREADABLE or (kind == "keys" and not all(type(k) in _PLAIN for k in value)):
        return None
    return BakedValue(guard.name, kind, value)


# Guards on an object's identity, which torch's precompile drops (it cannot save one).
_IDENTITY_GUARDS = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH"})


def _function_by_identity(guard: Any) -> bool:
    """A function the model holds in an attribute (``self.act = F.silu``, chosen by a constructor's
    argument), guarded by identity: the saved guards lose that, and an entry compiled for one function
    ran for another (a fuzzer's tanh model trained silu's graph). Kept by its qualified name and code."""
    kinds = {guard.guard_type, *guard.derived_guard_types}
    return bool(kinds & _IDENTITY_GUARDS) and isinstance(guard.value, types.FunctionType | types.BuiltinFunctionType)


def readable(name: str) -> bool:
    """Whether ``guarded_value`` can read a guard of this name."""
    return _PATH_NAME.fullmatch(name) is not None or _CLASS_ATTRIBUTE.fullmatch(name) is not None


def guarded_value(name: str, scope: dict[str, Any], f_locals: dict[str, Any]) -> Any:
    """The value a guard's name reads now, from a frame's globals (``G[...]``) and its arguments,
    or ``_UNREADABLE``."""
    try:
        parsed = _parsed(name)
        if parsed is None:
            return _UNREADABLE
        owner_steps, mro_index, attribute = parsed
        value = _walk(owner_steps, scope, f_locals)
        if attribute is None:
            return value
        return vars(type(value).__mro__[mro_index])[attribute]
    except (AttributeError, LookupError, TypeError):
        return _UNREADABLE


@functools.cache
def _parsed(name: str) -> tuple[tuple[tuple[str, ...], ...], int, str | None] | None:
    """A guard's name as (the steps of the path it starts from, and for a class's attribute read through
    that path's type: the index in its ``__mro__`` and the attribute), parsed once: the per-call check
    (``BakedCheck``) reads the same names at every call."""
    if m := _CLASS_ATTRIBUTE.fullmatch(name):
        return tuple(_PATH_STEP.findall(m.group(1))), int(m.group(2) or 0), m.group(3)
    if _PATH_NAME.fullmatch(name) is None:
        return None
    return tuple(_PATH_STEP.findall(name)), 0, None


def _walk(steps: tuple[tuple[str, ...], ...], scope: dict[str, Any], f_locals: dict[str, Any]) -> Any:
    value: Any = None
    for global_name, local, attr, key, index in steps:
        value = (scope[global_name] if global_name else f_locals[local] if local else getattr(value, attr) if attr
                 else value[key] if not index else value[int(index)])  # fmt: skip
    return value


def root_present(name: str, scope: dict[str, Any], f_locals: dict[str, Any]) -> bool:
    """Whether the global or argument a guard's name starts from is in the loading frame: when it is, a
    value that cannot be read through it (``CFG`` now None, a key gone) has changed."""
    parsed = _parsed(name)
    if parsed is None or not parsed[0]:
        return False
    global_name, local = parsed[0][0][:2]
    return (global_name in scope) if global_name else (local in f_locals)


def argument_read(name: str) -> str | None:
    """The frame's argument a guard's name starts from (``self``), or None (a global)."""
    parsed = _parsed(name)
    if parsed is None or not parsed[0]:
        return None
    _, local, *_ = parsed[0][0]
    return local or None


def said_name(name: str) -> str:
    """A guard's name as a user writes it: ``G['__import_mylib'].BOOST`` is ``mylib.BOOST``,
    ``dict(type(self).__dict__)['SCALE']`` is ``type(self).SCALE``."""
    name = _CLASS_ATTRIBUTE.sub(lambda m: f"type({m.group(1)})" + (f".__mro__[{m.group(2)}]" if m.group(2) else "")
                                + f".{m.group(3)}", name)  # fmt: skip
    return re.sub(r"G\['([^']+)'\]", lambda m: m.group(1).removeprefix("__import_").replace("_dot_", "."), name)


def same(a: Any, b: Any) -> bool:
    """Equal as the record compares: of one type (True is not 1), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


@functools.cache
def file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass(frozen=True)
class TracedFrom:
    """The files an entry was traced from, by digest, and the values it baked in (module docstring)."""

    files: dict[str, str]
    values: tuple[BakedValue, ...] = field(default=())

    MAGIC = b"accelrun-sources "  # the entry file's first line: this, the record as JSON, a newline

    @classmethod
    def of(cls, files: set[str], values: tuple[BakedValue, ...] = (), imported_at: float = float("inf")) -> TracedFrom:
        """The record of ``files`` as they are now; refused when one changed after ``imported_at`` (the code
        this process traced may be the older)."""
        skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(accelrun.__file__) + os.sep)
        paths = [f for f in sorted({os.path.abspath(f) for f in files if os.path.isfile(f)}) if not f.startswith(skip)]
        if edited := [f for f in paths if os.stat(f).st_mtime > imported_at]:
            raise RuntimeError(f"{edited[0]} changed while this process ran (its traced code may be older)")
        return cls({f: file_digest(f) for f in paths}, tuple(values))

    def with_entry(self, data: bytes) -> bytes:
        record = {"files": self.files, "values": [[v.name, v.kind, v.value] for v in self.values]}
        return self.MAGIC + json.dumps(record).encode() + b"\n" + data

    @classmethod
    def split(cls, data: bytes) -> tuple[TracedFrom, bytes]:
        """(the record, the entry's bytes) of an entry file."""
        header, _, entry = data.partition(b"\n")
        if not header.startswith(cls.MAGIC):
            raise RuntimeError("no record of the files it was traced from")
        record = json.loads(header[len(cls.MAGIC):])
        values = tuple(BakedValue(name, kind, value) for name, kind, value in record.get("values", []))
        return cls(dict(record.get("files", {})), values), entry

    def changed_file(self) -> str | None:
        """The first file that is gone or differs from when the entry was compiled, or None."""
        for path, digest in self.files.items():
            if not os.path.isfile(path) or file_digest(path) != digest:
                return path
        return None

    def changed_value(self, scope: dict[str, Any], f_locals: dict[str, Any]) -> str | None:
        """The first baked value that reads otherwise now, from the loading frame's globals and its
        arguments, in words; None when all read as traced (``BakedValue.reads_as``)."""
        for v in self.values:
            now = v.now(scope, f_locals)
            if not v.reads_as(v.value, now, scope, f_locals):
                return v.said(now)
        return None

"""torch.nn's RNN, GRU and LSTM modules run eagerly, and the code around them compiles.

Dynamo does not trace these modules (``torch._dynamo.config.allow_rnn`` unrolls every time step into
the graph instead), and it meets one when it reads the attribute that holds it (``self.rnn``), not
when it calls it. A graph break there has no place to resume from, so Dynamo skips the whole frame:
a language model of an embedding, a GRU and a head compiled nothing. Read as an ``EagerCall`` instead,
whose ``__call__`` is ``torch.compiler.disable``d, the module is called eagerly at a graph break that
Dynamo can resume from: the code before and after it compiles, and the break is named.

``EagerCall`` shadows the attribute in the parent's ``__dict__`` (an instance attribute wins over
``nn.Module``'s lookup in ``_modules``), so the module tree stays as it was: parameter names, state
dicts, ``.to()`` and optimizers see the same module; it shares the module's parameters, buffers and
children and hands every other attribute and the methods an RNN has of its own to the module, so code
that walks the model by attribute (torch.distributed.checkpoint, ``get_parameter("rnn.weight_ih_l0")``)
finds what it found before. (``torch.compiler.disable(module)`` itself returns an ``OptimizedModule``,
whose attributes torch's checkpointing expects to start with ``_orig_mod``.)

It stands in only where the model's own code does nothing with the attribute but call it
(``self.rnn(x)``) and read its plain settings (``self.rnn.hidden_size`` for an initial state), as read
from the source of every class of the model outside torch. Those settings are copied onto the
stand-in, where Dynamo reads them as constants. A forward that passes the attribute to ``isinstance``,
reads a weight through it or sets it later would meet an object that is not the RNN (Dynamo could not
read through it, and ``isinstance`` would answer otherwise), so such a model keeps its RNN as it is,
and the report says why nothing compiled. (A setting changed on the RNN itself afterwards, not
through the attribute, is not seen by the copy.)
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

# What Dynamo refuses to wrap (torch/_dynamo/variables/builder.py): these three, not every RNNBase.
RNN_MODULES = (nn.RNN, nn.GRU, nn.LSTM)
REASON = "accelrun: torch.compile does not trace torch.nn's RNN, GRU and LSTM modules; this one runs eagerly"
# (torch's containers call their children through ``_modules``, so a shadow there would never be read)
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class EagerRnn:
    name: str  # in the model, as named_modules() names it: "rnn", "blocks.0.lstm"
    kind: str  # "GRU"


class EagerCall(nn.Module):
    """Calls ``module`` where Dynamo does not trace, and otherwise stands for it: its parameters, buffers
    and children are the module's own (the same dictionaries), so ``get_submodule`` / ``get_parameter``
    paths through it and changes made through it reach the module; other attributes, and the methods
    that RNNs define over nn.Module's, are the module's."""

    def __init__(self, module: nn.Module, settings: frozenset[str] = frozenset()) -> None:
        # no nn.Module.__init__: every piece of state is the module's; ``settings`` (plain values the
        # model's code reads through the attribute) are copied, for Dynamo to read without a call
        object.__setattr__(self, "module", module)
        for state in ("_parameters", "_buffers", "_modules"):
            object.__setattr__(self, state, module.__dict__[state])
        for name in settings:
            object.__setattr__(self, name, module.__dict__[name])

    @torch.compiler.disable(reason=REASON)
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):  # only for names the instance itself lacks: the module's
        return getattr(object.__getattribute__(self, "module"), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.module, name, value)
        if name in object.__getattribute__(self, "__dict__"):  # a copied setting
            object.__setattr__(self, name, getattr(self.module, name))

    def __delattr__(self, name: str) -> None:
        delattr(self.module, name)

    # nn.Module's versions would run on the stand-in: RNNBase's own rebuild its flat weights (_apply).
    def forward(self, *args, **kwargs):
        return self.module.forward(*args, **kwargs)

    def _apply(self, fn, recurse: bool = True):
        self.module._apply(fn, recurse)
        return self

    def extra_repr(self) -> str:
        return self.module.extra_repr()

    def __setstate__(self, state: dict) -> None:  # a copy of the model: nn.Module's would set hooks on the module
        object.__getattribute__(self, "__dict__").update(state)

    def __repr__(self) -> str:
        return f"EagerCall({self.module!r})"


def run_rnns_eagerly(model: nn.Module) -> list[EagerRnn]:
    """Shadow every RNN, GRU and LSTM module that a module of ``model`` holds as a named attribute,
    which the model's code only calls and reads settings of (``settings_read``), with an
    ``EagerCall``; returns every RNN that runs eagerly this way (shadowed now or by an earlier call).
    Ones inside torch's containers are left as they are: the frame that calls them still runs eagerly
    whole."""
    found = []
    sources = _ModelSources(model)
    for parent_name, parent in model.named_modules():
        if isinstance(parent, CONTAINERS):
            continue
        for name, child in parent._modules.items():
            if not isinstance(child, RNN_MODULES) or not name.isidentifier():
                continue
            shadow = parent.__dict__.get(name)
            if shadow is None and (settings := sources.settings_read(name, child)) is not None:
                shadow = parent.__dict__[name] = EagerCall(child, settings)
            if isinstance(shadow, EagerCall) and shadow.module is child:
                found.append(EagerRnn(f"{parent_name}.{name}" if parent_name else name, type(child).__name__))
    return found


class _ModelSources:
    """The syntax trees of the model's own classes (each class of its modules and their bases, torch's
    left out: they reach an RNN through ``_modules`` or not at all)."""

    def __init__(self, model: nn.Module) -> None:
        classes = dict.fromkeys(c for m in model.modules() for c in type(m).__mro__)
        # (torchaudio's or torchvision's classes are read like the user's: only torch's own are skipped)
        self.classes = [c for c in classes if c.__module__ != "torch" and not c.__module__.startswith("torch.")
                        and c is not object]  # fmt: skip
        self._trees: dict[type, ast.AST | None] = {}

    def settings_read(self, name: str, module: nn.Module) -> frozenset[str] | None:
        """The settings of ``module`` (plain values: ``hidden_size``, ``num_layers``, ...) that these
        classes read through ``.name``, where every other mention of ``.name`` is a call
        (``self.name(x)``) or, in an ``__init__``, an assignment; None otherwise, or where a class's
        source cannot be read (it might do anything)."""
        # ("training" is set on the RNN itself by model.train(): a copy would go stale)
        settings = frozenset(k for k, v in module.__dict__.items()
                             if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str)))
        read: set[str] = set()
        for cls in self.classes:
            tree = self._tree(cls)
            if tree is None or (found := _settings_read_in(tree, name, settings)) is None:
                return None
            read |= found
        return frozenset(read)

    def _tree(self, cls: type) -> ast.AST | None:
        if cls not in self._trees:
            try:
                self._trees[cls] = ast.parse(textwrap.dedent(inspect.getsource(cls)))
            except (OSError, TypeError, SyntaxError):  # no source: a class made by exec, or in C
                self._trees[cls] = None
        return self._trees[cls]


def _settings_read_in(tree: ast.AST, name: str, settings: frozenset[str]) -> set[str] | None:
    """The ``settings`` read as ``<x>.name.<setting>`` in ``tree``, or None if ``.name`` is used in any
    other way than that, a call, or an assignment in an ``__init__``."""
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    set_in_init = {id(target) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name == "__init__"
                   for node in ast.walk(fn) if isinstance(node, (ast.Assign, ast.AnnAssign))
                   for target in (node.targets if isinstance(node, ast.Assign) else [node.target])}  # fmt: skip
    read_through = {id(node.value): node.attr for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in settings}
    read = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr != name:
            continue
        if id(node) in read_through:
            read.add(read_through[id(node)])
        elif id(node) not in called and id(node) not in set_in_init:
            return None
    return read


def described(rnns: list[EagerRnn]) -> str:
    """For the run's description of what was compiled: which modules run eagerly where compiled code calls them."""
    if not rnns:
        return ""
    shown = ", ".join(r.name for r in rnns[:3]) + (f" and {len(rnns) - 3} more" if len(rnns) > 3 else "")
    kinds = "/".join(sorted({r.kind for r in rnns}))
    return f"; {shown} ({kinds}) run{'s' if len(rnns) == 1 else ''} eagerly at a graph break"

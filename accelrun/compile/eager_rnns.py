"""torch.nn's RNN, GRU and LSTM modules run eagerly, and the code around them compiles.

Dynamo does not trace these modules (``torch._dynamo.config.allow_rnn`` unrolls every time step into
the graph instead), and it meets one when it reads the attribute that holds it (``self.rnn``), not
when it calls it. A graph break there has no place to resume from, so Dynamo skips the whole frame:
a language model of an embedding, a GRU and a head compiled nothing. Read as an ``EagerCall`` instead,
whose ``__call__`` is ``torch.compiler.disable``d, the module is called eagerly at a graph break that
Dynamo can resume from: the code before and after it compiles, and the break is named.

``EagerCall`` shadows the attribute in the parent's ``__dict__`` (an instance attribute wins over
``nn.Module``'s lookup in ``_modules``), so the module tree stays as it was: parameter names, state
dicts, ``.to()`` and optimizers see the same module; and it hands every other attribute to the module,
so code that walks the model by attribute (torch.distributed.checkpoint, ``self.rnn.hidden_size``)
finds what it found before. (``torch.compiler.disable(module)`` itself returns an ``OptimizedModule``,
whose attributes torch's checkpointing expects to start with ``_orig_mod``.)
"""

from __future__ import annotations

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
    """Calls ``module`` where Dynamo does not trace, and otherwise stands for it: its attributes,
    parameters, buffers and children are the module's own (the same dictionaries), so
    ``get_submodule`` / ``get_parameter`` paths through it and changes made through it reach the module."""

    def __init__(self, module: nn.Module) -> None:  # no nn.Module.__init__: every piece of state is the module's
        object.__setattr__(self, "module", module)
        for state in ("_parameters", "_buffers", "_modules"):
            object.__setattr__(self, state, module.__dict__[state])

    @torch.compiler.disable(reason=REASON)
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):  # only for names the instance itself lacks: the module's
        return getattr(object.__getattribute__(self, "module"), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.module, name, value)

    def __setstate__(self, state: dict) -> None:  # a copy of the model: nn.Module's would set hooks on the module
        object.__getattribute__(self, "__dict__").update(state)

    def __repr__(self) -> str:
        return f"EagerCall({self.module!r})"


def run_rnns_eagerly(model: nn.Module) -> list[EagerRnn]:
    """Shadow every RNN, GRU and LSTM module that a module of ``model`` holds as a named attribute
    with an ``EagerCall``; returns what it shadowed. Ones inside torch's
    containers are left as they are: the frame that calls them still runs eagerly whole."""
    found = []
    for parent_name, parent in model.named_modules():
        if isinstance(parent, CONTAINERS):
            continue
        for name, child in parent._modules.items():
            if isinstance(child, RNN_MODULES) and name.isidentifier() and name not in parent.__dict__:
                parent.__dict__[name] = EagerCall(child)
                found.append(EagerRnn(f"{parent_name}.{name}" if parent_name else name, type(child).__name__))
    return found


def described(rnns: list[EagerRnn]) -> str:
    """For the run's description of what was compiled: which modules run eagerly between the graphs."""
    if not rnns:
        return ""
    shown = ", ".join(r.name for r in rnns[:3]) + (f" and {len(rnns) - 3} more" if len(rnns) > 3 else "")
    kinds = "/".join(sorted({r.kind for r in rnns}))
    return f"; {shown} ({kinds}) run{'s' if len(rnns) == 1 else ''} eagerly between compiled graphs"

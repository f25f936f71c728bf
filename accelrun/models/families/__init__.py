"""Model families: one folder each, one :class:`ModelSpec` per family, one registry line.

A spec is what the rest of accelrun asks instead of assuming Llama: how to build the model on the
meta device, its FLOPs per token and parameter count, its tensor-parallel plan (data; ``dist.tp``
applies it), how it splits into pipeline stages, and how Hugging Face config keys and weight names
map onto it. The planner (torch-free) asks the family's ``shape`` module for the step's shape.

Adding a family: a folder ``families/<name>/`` holding everything of the family, with

- ``model.py``: the module (built on meta; ``init_weights(seed)`` keyed by ``shard_init.param_key``),
- ``spec.py`` defining ``SPEC`` (its ``__init__`` hands it out lazily, so that the folder can be
  imported without torch),
- ``shape.py`` defining ``plan_shape(model_config) -> accelrun.plan.workload.Shape`` and the family's
  ``param_count`` and ``flops_per_token`` from that shape (torch-free),

and one line in :data:`FAMILIES` below, which ``model.arch`` is checked against (plus its ``model_type``
line in ``config/hf_model.py`` to load Hugging Face folders). ``tests/models/test_add_a_family.py``
does this with a toy family.

>>> get_family("llama").name
'llama'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from accelrun.errors import UserError

if TYPE_CHECKING:  # torch stays out of `import accelrun.models.families` (the planner imports it)
    from torch import nn

# name -> the family's package. One line per family.
FAMILIES = {
    "llama": "accelrun.models.families.llama",
    "gemma": "accelrun.models.families.gemma",
    "moe": "accelrun.models.families.moe",
}


@dataclass(frozen=True)
class TPPlan:
    """Tensor-parallel plans as data: per block (plain and sequence-parallel) and for the model's ends."""

    block: dict[str, Any]
    sequence_parallel_block: dict[str, Any]
    ends: Callable[[nn.Module, bool, bool], dict[str, Any]]  # (model, sequence_parallel, vocab_parallel_loss)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args_from_config: Callable[[Any], Any]  # ModelConfig -> the family's shape arguments
    build: Callable[[Any], nn.Module]  # args -> module (call under torch.device("meta"))
    flops_per_token: Callable[[Any, int], float]  # (args, seq_len) -> training FLOPs per token
    param_count: Callable[..., int]  # (args, embeddings=True) -> distinct parameters
    tp_plan: TPPlan
    # Pipeline split: the ModuleList of repeated blocks and the ends only the first / last stage keeps.
    blocks_attr: str = "layers"
    first_stage_ends: tuple[str, ...] = ()
    last_stage_ends: tuple[str, ...] = ()
    # Hugging Face weights: (state dict of HF names, args) -> accelrun names, and back.
    state_dict_from_hf: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    state_dict_to_hf: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    hf_name: Callable[[str, Any], str] | None = None  # accelrun name -> HF name
    hf_config: Callable[[Any], dict[str, Any]] | None = None  # args -> config.json contents
    # (accelrun name, HF tensor or a block of its rows, args) -> accelrun's layout; rows read together.
    hf_from_tensor: Callable[[str, Any, Any], Any] | None = None
    hf_row_block: Callable[[str, Any], int] | None = None
    # Context parallelism: (model, make_attention, cp_rank, cp_size) -> None makes the model run on this
    # rank's sequence chunks (accelrun.models.sequence_chunks): rotary positions from the chunks' global
    # ones, each attention layer's core replaced by make_attention() (accelrun.dist.context_parallel).
    # None: the family's attention cannot be sharded along the sequence (parallel.cp > 1 is refused).
    shard_sequence: Callable[[nn.Module, Callable[[], nn.Module], int, int], None] | None = None
    # The output layer's parameter name, which a tied checkpoint leaves out of its files.
    tied_output_name: str = "output.weight"
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, module: Callable[[Any], nn.Module], args: Any, shape: Any, hf: Any = None,
           **fields: Any) -> ModelSpec:
        """The spec of a family folder's pieces: ``module(args)`` builds it, ``args.from_config`` reads the
        recipe, ``shape`` gives FLOPs and parameters, and ``hf`` (its ``hf.py``, if it has one) whichever
        of the Hugging Face conversions it defines; ``fields`` are the rest of the spec."""
        conversions = {field_name: getattr(hf, attr) for field_name, attr in _HF_FUNCTIONS.items()
                       if hf is not None and hasattr(hf, attr)}
        return cls(name=name, args_from_config=args.from_config, build=module, flops_per_token=shape.flops_per_token,
                   param_count=shape.param_count, **conversions, **fields)

    @property
    def ends(self) -> tuple[str, ...]:
        """Every module outside the repeated blocks, first stage's then last stage's."""
        return self.first_stage_ends + self.last_stage_ends


# ModelSpec field -> the function of that name a family's hf.py defines.
_HF_FUNCTIONS = {"state_dict_from_hf": "state_dict_from_hf", "state_dict_to_hf": "state_dict_to_hf",
                 "hf_name": "hf_name", "hf_config": "hf_config", "hf_from_tensor": "from_hf_tensor",
                 "hf_row_block": "row_block"}


class UnknownFamily(UserError, ValueError):
    pass


def _package(name: str) -> str:
    if name not in FAMILIES:
        raise UnknownFamily(f"model.arch = {name!r}: no such model family; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def get_family(name: str) -> ModelSpec:
    return importlib.import_module(_package(name)).SPEC


def plan_shape(model_config: Any) -> Any:
    """The planner's ``Shape`` of a recipe's ``model`` section, from its family's ``shape`` module
    (torch-free)."""
    package = _package(model_config.arch)
    try:
        module = importlib.import_module(package + ".shape")
    except ModuleNotFoundError as e:
        if e.name != package + ".shape":
            raise
        raise UserError(f"model.arch = {model_config.arch!r}: accelrun plan cannot model this family yet "
                        f"(it has no {package}.shape module)") from None
    return module.plan_shape(model_config)


def family_names() -> list[str]:
    return sorted(FAMILIES)

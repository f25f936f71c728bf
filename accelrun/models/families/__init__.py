"""Model families: one folder each, one :class:`ModelSpec` per family, one registry line.

A spec is what the rest of accelrun asks instead of assuming Llama: how to build the model on the
meta device, its FLOPs per token and parameter count, its tensor-parallel plan (data; ``dist.tp``
applies it), how it splits into pipeline stages, and how Hugging Face config keys and weight names
map onto it. Adding a family: a folder ``families/<name>/`` whose ``__init__`` defines ``SPEC``, and
one line in :data:`FAMILIES` below (plus its ``model_type`` lines in ``config/hf_model.py``).

>>> get_family("llama").name
'llama'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from accelrun.errors import UserError


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
    extras: dict[str, Any] = field(default_factory=dict)


class UnknownFamily(UserError, ValueError):
    pass


def _families() -> dict[str, ModelSpec]:
    from accelrun.models.families import llama, moe

    return {"llama": llama.SPEC, "moe": moe.SPEC}  # one line per family


def get_family(name: str) -> ModelSpec:
    families = _families()
    if name not in families:
        raise UnknownFamily(f"model.arch = {name!r}: no such model family; known: {', '.join(sorted(families))}")
    return families[name]


def family_names() -> list[str]:
    return sorted(_families())

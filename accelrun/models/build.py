"""Turn a recipe's ``model:`` section into an ``nn.Module``: a model family's (``model.arch``), or a
user's model.

A user's model is named by import path, ``model.custom: "package.module:factory"``; the factory is
called with ``model.kwargs`` under ``torch.device(device)``, so tensors it creates without an explicit
device land there (including "meta").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accelrun.errors import UserError

if TYPE_CHECKING:  # the schema imports pydantic; keep it out of `import accelrun.models`
    from accelrun.config.schema import ModelConfig


class ModelBuildError(UserError, ValueError):
    """A model the recipe names cannot be built; the message names the recipe key at fault."""


def build_model(
    cfg: ModelConfig, device: torch.device | str = "meta", *, seed: int | None = None
) -> nn.Module:
    """Build the model a recipe describes.

    A family's model is always built on the meta device first; for any other ``device`` it is then materialised
    there (``to_empty``) and initialised (``init_weights(seed)``). A training loop that parallelises
    the model should build on meta, apply its wrappers, and then materialise and initialise itself.

    >>> from accelrun.config.schema import ModelConfig
    >>> build_model(ModelConfig(dim=64, n_layers=2, n_heads=4), "cpu").output.weight.device
    device(type='cpu')
    """
    device = torch.device(device)
    if cfg.custom is not None:
        return _build_custom(cfg.custom, cfg.kwargs, device)
    spec = family_spec(cfg)
    args = spec.args_from_config(cfg)
    with torch.device("meta"):
        model = spec.build(args)
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights(seed=seed)
    return model


def materialize_local(model: nn.Module, device: torch.device | str, *, seed: int) -> None:
    """Allocate what this process holds of a model built on meta (after its parallel layout is
    applied: the local shards of sharded parameters, this rank's pipeline stage) and initialise it.

    Every element gets the value a one-process ``build_model(cfg, device, seed=seed)`` gives it,
    however the model is cut (``Llama.init_weights``, ``accelrun.models.shard_init``).
    """
    model.to_empty(device=torch.device(device))
    model.init_weights(seed=seed)


def family_spec(cfg: ModelConfig):
    """The ``ModelSpec`` of the recipe's family (``model.arch``; see ``accelrun.models.families``)."""
    from accelrun.models.families import get_family

    return get_family(cfg.arch)


def _build_custom(path: str, kwargs: dict[str, Any], device: torch.device) -> nn.Module:
    where = f"model.custom = {path!r}"
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            detail = f"no module named {e.name!r} (is its folder on PYTHONPATH?)"
        else:  # the module exists but something it imports does not
            detail = f"importing {module_name!r} failed: {e}"
        raise ModelBuildError(f"{where}: {detail}") from e
    except Exception as e:
        raise ModelBuildError(f"{where}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e

    factory = module
    for part in attr.split("."):  # "module:Class.create" reaches a nested attribute
        if not hasattr(factory, part):
            raise ModelBuildError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelBuildError(f"{where}: {attr!r} is a {type(factory).__name__}, not a callable")

    try:
        with device:
            model = factory(**kwargs)
    except Exception as e:
        raise ModelBuildError(
            f"{where}: calling {attr}(**model.kwargs) with model.kwargs = {kwargs!r} failed: "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(model, nn.Module):
        raise ModelBuildError(
            f"{where}: {attr}(...) returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The model's repeated blocks, for the training loop to wrap (checkpointing, per-block compile).

    A built-in model's are where its family's spec says (``blocks_attr``); a user's model's are
    ``model.layers`` by convention. That attribute is an ``nn.ModuleList`` or, for a pipeline stage, an
    ``nn.ModuleDict``; None otherwise.
    """
    layers = getattr(model, _blocks_attr(model), None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    return list(layers) if isinstance(layers, nn.ModuleList) else None


def _blocks_attr(model: nn.Module) -> str:
    from accelrun.models.families import FAMILIES, get_family

    arch = getattr(getattr(model, "args", None), "arch", None)
    return get_family(arch).blocks_attr if arch in FAMILIES else "layers"


def model_flops_per_token(cfg: ModelConfig, seq_len: int, model: nn.Module | None = None) -> float | None:
    """Training FLOPs per token (the family's, ``accelrun.plan.workload.Shape.model_flops_per_token``), or None when unknown.

    A user's model is unknown unless ``model`` is given and has a ``flops_per_token(seq_len)`` method.
    """
    if cfg.custom is None:
        spec = family_spec(cfg)
        return spec.flops_per_token(spec.args_from_config(cfg), seq_len)
    method = getattr(model, "flops_per_token", None)
    return float(method(seq_len)) if callable(method) else None


def model_summary(cfg: ModelConfig, model: nn.Module, seq_len: int | None = None) -> dict[str, Any]:
    """Facts about the model for logs and reports.

    Keys: ``arch`` (the family, or "custom"), ``custom`` (the import path or None), ``params_total``,
    ``params_non_embedding`` (None for a user's model), ``flops_per_token`` (training FLOPs per token
    at ``seq_len``; None when ``seq_len`` is not given or the model cannot say).
    A family's counts come from its shape, so they are the whole model's even when ``model`` is a shard
    or a pipeline stage; a user's model is counted from its (distinct) parameters.
    """
    if cfg.custom is None:
        spec = family_spec(cfg)
        args = spec.args_from_config(cfg)
        total: int = spec.param_count(args)
        non_embedding: int | None = spec.param_count(args, embeddings=False)
    else:
        total = sum(p.numel() for p in model.parameters())
        non_embedding = None
    return {
        "arch": "custom" if cfg.custom is not None else cfg.arch,
        "custom": cfg.custom,
        "params_total": total,
        "params_non_embedding": non_embedding,
        "flops_per_token": None if seq_len is None else model_flops_per_token(cfg, seq_len, model),
    }


def takes_document_positions(model: nn.Module) -> bool:
    """Whether the model's forward takes ``positions_BT`` (document packing): the built-in families do."""
    import inspect

    return "positions_BT" in inspect.signature(model.forward).parameters


def training_loss_fn(model: nn.Module):
    """``(inputs, targets[, positions]) -> mean cross-entropy``: the model's own loss head when its forward
    takes targets (the built-in families: the head then compiles with ``compile.scope: loss`` or ``model``),
    otherwise cross-entropy over the logits it returns. ``positions`` (document packing) is passed on as
    ``positions_BT`` only when given, so concat packing calls the model exactly as before."""
    import inspect

    import torch.nn.functional as F

    params = inspect.signature(model.forward).parameters
    if "targets_BT" in params:
        def own_loss(inputs_BT, targets_BT, positions_BT=None):
            if positions_BT is None:
                return model(inputs_BT, targets_BT)
            return model(inputs_BT, targets_BT, positions_BT=positions_BT)

        return own_loss

    def loss(inputs_BT, targets_BT):
        logits_BTV = model(inputs_BT)
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())

    return loss

"""Turn a recipe's ``model:`` section into an ``nn.Module``: a model family's (``model.arch``), or a
user's model.

A user's model is named by import path, ``model.custom: "package.module:factory"``; the factory is
called with ``model.kwargs`` under ``torch.device(device)``, so tensors it creates without an explicit
device land there (including "meta").
"""

from __future__ import annotations

import importlib
import re
import sys
import weakref
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accelrun.data.loss_mask import IGNORE_INDEX
from accelrun.errors import UserError
from accelrun.models.causal_lm_head import attach_loss_head, loss_head_attached, next_token_loss
from accelrun.models.custom_import import module_callables, search_current_folder

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


def raised_at(e: BaseException) -> str:
    """`` at file:line`` of the innermost frame of ``e``'s traceback in the user's code: not in torch,
    accelrun, Python's standard library or installed packages (a factory that reads a file fails in
    pathlib, and its own line is the one to name); the path relative to the working directory where
    it is under it; "" if no frame is."""
    import sysconfig
    import traceback

    libraries = {Path(torch.__file__).parent, Path(__file__).parents[1],
                 *(Path(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        file = Path(frame.filename)
        if file.is_file() and not any(file.is_relative_to(root) for root in libraries):
            shown = file.relative_to(Path.cwd()) if file.is_relative_to(Path.cwd()) else file
            return f" at {shown}:{frame.lineno}"
    return ""


def _build_custom(path: str, kwargs: dict[str, Any], device: torch.device) -> nn.Module:
    where = f"model.custom = {path!r}"
    factory, attr = resolve_custom(path)
    check_kwargs_types(factory, attr, path, kwargs)  # passed as given: a wrong type builds another model
    try:
        with device:
            model = factory(**kwargs)
    except Exception as e:
        if isinstance(e, TypeError):  # model.kwargs that do not fit, with the nearest that would (as validate)
            check_custom_kwargs(path, kwargs)  # (a signature that under-describes the factory is not refused)
        raise ModelBuildError(
            f"{where}: calling {attr}(**model.kwargs) with model.kwargs = {kwargs!r} failed{raised_at(e)}: "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(model, nn.Module):
        raise ModelBuildError(
            f"{where}: {attr}(...) returned a {type(model).__name__}, not a torch.nn.Module"
        )
    if "torch._dynamo" in sys.modules:  # (a model torch.compile returned needs Dynamo imported)
        from accelrun.torch_private import OptimizedModule

        if isinstance(model, OptimizedModule):
            # compile.backend decides how it compiles: compiled twice, Dynamo traced accelrun's own
            # compile of it and its step was 1.5× the unwrapped model's (a new user's trial)
            model = model._orig_mod
            FACTORY_COMPILED.add(model)
    if needed := arguments_never_passed(model):
        raise ModelBuildError(
            f"{where}: {type(model).__name__}.forward needs {', '.join(repr(n) for n in needed)}, which accelrun "
            "does not pass: it calls forward(tokens), and passes the targets too where the forward takes "
            f"'targets' or 'targets_BT'; give {'it a default' if len(needed) == 1 else 'them defaults'} "
            f"(e.g. {needed[0]}=None)"
        )
    attach_loss_head(model)  # transformers' causal LMs: the head and loss as one step, as a family's
    return model


# What training passes a user's forward besides the tokens, where its signature names them (training_loss_fn).
PASSED_BY_NAME = frozenset({"targets", "targets_BT", "positions_BT", "use_cache"})


def arguments_never_passed(model: nn.Module) -> list[str]:
    """The forward's parameters without a default that training never fills: any after the tokens (its
    first), but the targets and positions it passes by name. A forward whose signature cannot be read
    (a builtin) is taken as fitting."""
    import inspect

    raw = inspect.getattr_static(type(model), "forward", None)
    if raw is None:
        return []
    try:  # bound as training calls it: the instance (a method) or the class (a classmethod) taken
        params = list(inspect.signature(raw.__get__(model, type(model))).parameters.values())
    except (TypeError, ValueError, AttributeError):  # a builtin, an unusual descriptor: taken as fitting
        return []
    needed, tokens_seen = [], False
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not inspect.Parameter.empty:
            continue
        if not tokens_seen and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            tokens_seen = True
            continue
        if p.name not in PASSED_BY_NAME:
            needed.append(p.name)
    return needed


def _module_name_for(file: str, attr: str) -> str:
    """What to write for a file given where ``model.custom`` takes a module: its dotted name from the
    current folder (searched), or, for a file outside it or under folders whose names no import can
    spell (``my-models``), its folder added to PYTHONPATH and its name."""
    import shlex

    path = Path(file if file.endswith(".py") else file + ".py").expanduser().resolve()
    if path.is_relative_to(Path.cwd()):
        parts = path.relative_to(Path.cwd()).with_suffix("").parts
        if all(part.isidentifier() for part in parts):
            return ".".join(parts) + f":{attr}"
    return f"PYTHONPATH={shlex.quote(str(path.parent))}:$PYTHONPATH accelrun ... model.custom={path.stem}:{attr}"


def resolve_custom(path: str) -> tuple[Any, str]:
    """``model.custom``'s factory (imported, not called) and its attribute path; ModelBuildError naming
    the key when the module, the attribute or a callable is missing."""
    where = f"model.custom = {path!r}"
    module_name, _, attr = path.partition(":")
    search_current_folder()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            detail = f"no module named {e.name!r} (looked in the current folder and on PYTHONPATH)"
            if "/" in module_name or module_name.endswith(".py"):  # a file path where a module name goes
                detail += "; model.custom takes a module name, not a file: " + _module_name_for(module_name,
                                                                                               attr or "factory")
        else:  # the module exists but something it imports does not
            detail = f"importing {module_name!r} failed: {e}"
        raise ModelBuildError(f"{where}: {detail}") from e
    except Exception as e:
        raise ModelBuildError(f"{where}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e

    factory = module
    for part in attr.split("."):  # "module:Class.create" reaches a nested attribute
        if not hasattr(factory, part):
            from accelrun.config.errors import nearest

            names = module_callables(factory)
            near = nearest(part, names)
            shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
            hint = f"; did you mean {near!r}?" if near else (f"; its callables: {shown}" if names else "")
            raise ModelBuildError(f"{where}: module {module_name!r} has no attribute {attr!r}{hint}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelBuildError(f"{where}: {attr!r} is a {type(factory).__name__}, not a callable")
    return factory, attr


# Users' models whose factory returned ``torch.compile(model)``: the module inside is the one built
# (compile_model says so in the run's description of what compiled).
FACTORY_COMPILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class ModelKwargsError(ModelBuildError):
    """model.kwargs do not fit model.custom's factory. ``name``: the argument at fault where there is one
    (a misspelt or mistyped key, whose own line the recipe error names), else None."""

    def __init__(self, messages: str | list[str], name: str | None = None):
        super().__init__(messages)
        self.name = name


def check_custom_kwargs(path: str, kwargs: dict[str, Any]) -> None:
    """``model.kwargs`` fit the factory's signature (before anything is built): ModelKwargsError naming
    the argument that does not, and the ones it takes."""
    import inspect

    factory, attr = resolve_custom(path)
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C extension: nothing to check against
        return
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        params = signature.parameters
        names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        unknown = (next((n for n in kwargs if n not in params), None)  # the line of the key the error is about
                   if "unexpected keyword" in str(e) else None)  # (None: one required is missing)
        raise ModelKwargsError(f"model.kwargs = {kwargs!r} do not fit model.custom = {path!r}: {e} "
                               f"({attr} takes {', '.join(names) or 'no arguments'}){_kwargs_fix(signature, kwargs)}",
                               name=unknown) from None
    check_kwargs_types(factory, attr, path, kwargs)


def check_kwargs_types(factory: Any, attr: str, path: str, kwargs: dict[str, Any]) -> None:
    """ModelKwargsError naming the first of ``kwargs`` of a type the factory does not take."""
    if found := kwargs_type_problem(factory, attr, kwargs):
        name, problem = found
        raise ModelKwargsError(f"model.kwargs do not fit model.custom = {path!r}: {problem}", name=name)


def kwargs_type_problem(factory: Any, attr: str, kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """(name, the problem in words) of the first of ``kwargs`` whose value is not of the type the factory's
    annotation names (bool, int, float, str, None, a Literal, a union of those), with the nearest valid
    value; None if all fit or cannot be told. The factory gets the values as given: ``norm_first: flase``
    reached a ``bool`` argument as a (true) string and built the other model, silently (a new user's trial)."""
    hints = _annotations(factory)
    for name, value in kwargs.items():
        if name in hints and _fits(value, hints[name]) is False:
            return name, (f"model.kwargs.{name} = {value!r} ({type(value).__name__}), but {attr} takes "
                          f"{name}: {_type_words(hints[name])}{_nearest_value(value, hints[name])}")
    return None


def _annotations(factory: Any) -> dict[str, Any]:
    """The factory's parameters' annotations as types, each on its own: one that does not resolve (a
    type imported under TYPE_CHECKING) leaves that parameter unchecked, not every other one too."""
    import functools
    import inspect
    import typing

    while isinstance(factory, functools.partial):
        factory = factory.func
    fn = factory.__init__ if isinstance(factory, type) else factory
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 (a forward reference, a C extension): each on its own below
        pass
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    out = {}
    for name, param in params.items():
        ann = param.annotation
        if isinstance(ann, str):
            try:
                ann = eval(ann, getattr(fn, "__globals__", {}))  # noqa: S307 (the user's own annotation, as typing does)
            except Exception:  # noqa: BLE001
                continue
        if ann is not param.empty:
            out[name] = ann
    return out


def _fits(value: Any, annotation: Any) -> bool | None:
    """Whether ``value`` is of ``annotation``'s type; None where the annotation is not one told here."""
    import types
    import typing

    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:  # (True == 1: a boolean is no Literal[1])
        return any(value == a and type(value) is type(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        told = [_fits(value, a) for a in typing.get_args(annotation)]
        return True if any(told) else (None if None in told else False)
    return None


def _type_words(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _nearest_value(value: Any, annotation: Any) -> str:
    import typing

    from accelrun.config.errors import nearest

    if annotation is bool and isinstance(value, str):
        near = nearest(value.lower(), ["true", "false"]) or ("false" if value.lower() in ("no", "off", "0") else "true")
        return f"; write {near} (YAML's booleans are unquoted true and false)"
    if annotation is int and isinstance(value, bool):
        return "; write a whole number (true and false are booleans here)"
    if annotation is int and isinstance(value, float) and value.is_integer():
        return f"; write {int(value)}"
    if annotation in (int, float) and isinstance(value, str) and _is_number(value):
        return "; write the number unquoted"
    choices = [str(a) for a in typing.get_args(annotation)] if typing.get_origin(annotation) is typing.Literal else []
    if isinstance(value, str) and (near := nearest(value, choices)):
        return f"; did you mean {near!r}?"
    return ""


def _kwargs_fix(signature: Any, kwargs: dict[str, Any]) -> str:
    """The nearest valid model.kwargs: a misspelt name's nearest argument, or the required ones missing,
    written as an override."""
    from accelrun.config.errors import nearest

    params = signature.parameters
    takes = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for name, value in kwargs.items():
        key, colon, rest = name.partition(":")
        if name not in params and colon and value is None and key.strip() in params:  # YAML's `{d:96}`
            return (f"; YAML reads {name!r} without a space after the colon as one key with no value: "
                    f"write {{{key.strip()}: {rest.strip()}}}")
        if name not in params and (near := nearest(name, takes)):
            return f"; did you mean {near!r}?"
    missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]  # fmt: skip
    if missing:
        import yaml

        open_ended = any(p.kind == p.VAR_KEYWORD for p in params.values())
        kept = {k: v for k, v in kwargs.items() if k in params or open_ended}  # an unknown key would fail again
        given = ", ".join([*(f"{k}: {yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                             for k, v in kept.items()), *(f"{n}: ..." for n in missing)])
        return f"; pass {'it' if len(missing) == 1 else 'them'} as model.kwargs, e.g. \"model.kwargs={{{given}}}\""
    return ""


def embedding_rows(model: nn.Module) -> int | None:
    """The token ids a user's model takes: the rows of its token table (``token_table``), or None when
    it cannot be told (no ``nn.Embedding``, a token table kept as a bare parameter, several tables and no
    head as wide as one): the recipe's model.vocab_size then counts."""
    table = token_table(model)
    return None if table is None else table.num_embeddings


def token_table(model: nn.Module) -> nn.Embedding | None:
    """The first ``nn.Embedding`` whose rows equal the width of the model's output head and whose name is
    not a position table's (a position table does not match, whatever its size or place). The head is
    the last ``nn.Linear`` (registered last in the models users write) that some such table matches: a
    small head registered after it (an auxiliary ``nn.Linear(dim, 1)``) had made the model's token ids
    unknown, and its FLOPs were counted on ids drawn for another recipe's vocabulary. With no such head,
    the only table there is, if it is a vocabulary's size (``MIN_VOCABULARY``): its weight makes the logits
    (``F.linear(x, self.embed.weight)``, a tie written without an ``nn.Linear``), which had left the ids to a
    recipe's vocabulary the model never had. (A smaller lone table is a segment's or a class's, beside a
    token table kept as a bare parameter: model.vocab_size then counts.)"""
    tables = [m for name, m in model.named_modules() if isinstance(m, nn.Embedding) and not is_position_table(name)]
    for linear in reversed([m for m in model.modules() if isinstance(m, nn.Linear)]):
        if (table := next((t for t in tables if t.num_embeddings == linear.out_features), None)) is not None:
            return table
    return tables[0] if len(tables) == 1 and tables[0].num_embeddings >= MIN_VOCABULARY else None


# The fewest rows a lone embedding table may have to be taken for the token table: a byte-level
# tokenizer's 256 (segment, type and class tables have a few).
MIN_VOCABULARY = 256


def data_vocab(cfg: ModelConfig, model: nn.Module) -> tuple[int, str | None]:
    """(the token ids the data may hold, the model.custom that sets them or None): a user's model's token
    table rows (``embedding_rows``) where they can be told, else model.vocab_size."""
    rows = embedding_rows(model) if cfg.custom is not None else None
    return (cfg.vocab_size, None) if rows is None else (rows, cfg.custom)


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


def forward_parameters(model: nn.Module) -> Mapping[str, Any]:
    """The parameters of the model's own ``forward``, read from its class: compiling may put a wrapper
    that takes ``(*args, **kwargs)`` on the instance (the graph cache's method, the first-call check),
    and under ``compile.scope = model`` the targets and ``use_cache=False`` were then never passed."""
    import inspect

    forward = getattr(type(model), "forward", None)
    return inspect.signature(forward if forward is not None else model.forward).parameters


def takes_document_positions(model: nn.Module) -> bool:
    """Whether the model's forward takes ``positions_BT`` (document packing): the built-in families do."""
    return "positions_BT" in forward_parameters(model)


# A user's model's learned table of absolute positions, by its name: one with "pos" in its last part
# (GPT-2's and nanoGPT's ``wpe``, ``position_embedding_table`` of "let's build GPT", OPT's
# ``embed_positions``, ``pos_emb``, ``abs_pos_emb``), but not a table of relative positions or buckets
# (T5's ``relative_attention_bias``, a ``rel_pos_bias``), of parts of speech or of 2-D coordinates
# (``pos_tags``, ``x_position_embeddings``).
_POSITION_TABLE = re.compile(r"(^|\.)(wpe|[^.]*pos[^.]*)$", re.IGNORECASE)
_NOT_POSITIONS = re.compile(r"rel|bucket|bias|tag|(^|[._])[xy]_?pos", re.IGNORECASE)


def is_position_table(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return _POSITION_TABLE.search(name) is not None and _NOT_POSITIONS.search(last) is None


def position_table_problem(model: nn.Module, seq_len: int) -> str | None:
    """Why a user's model cannot take sequences of ``seq_len`` tokens (a learned position table with
    fewer rows, which the first step indexes past: a page of traceback from ``F.embedding``), or None;
    ``train`` and ``validate`` say the same."""
    tokens = token_table(model)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding) or not is_position_table(name) or m is tokens:
            continue
        offset = getattr(m, "offset", 0)  # OPT's table starts its positions 2 rows in
        positions = m.num_embeddings - (offset if isinstance(offset, int) else 0)
        if positions < seq_len:
            rows = f"{m.num_embeddings} rows" + (f", positions from row {offset}" if positions != m.num_embeddings else "")
            return (f"train.seq_len = {seq_len} is longer than model.custom's position table {name} ({rows}): set "
                    f"train.seq_len={positions} or less, or build the model with a longer table")
    return None


def document_packing_problem(model: nn.Module) -> str | None:
    """Why a user's model cannot train under ``data.packing: document`` (its forward takes no
    ``positions_BT``), or None; ``train`` and ``validate`` say the same."""
    if takes_document_positions(model):
        return None
    return (f"data.packing = document: model.custom's forward ({type(model).__name__}) takes no positions_BT "
            "(each token's position in its document), so it cannot keep attention inside documents; use "
            "data.packing: concat, or add the argument")


class LossSource(Enum):
    """Which loss training minimises (``training_loss_fn``); each value is what report.md says of it."""

    HEAD = ("the next-token cross-entropy of the model's head and loss as one step (forward(tokens, targets_BT)), "
            "with any term the model adds (a mixture's load-balancing loss, model.aux_loss_coef)")
    OWN = "the loss the model's forward returns given targets (forward(tokens, targets)), or where it returns " \
          "none, the next-token cross-entropy of its logits"
    # Which of OWN's two it was, once the forward has run (``training_loss_fn``'s ``trained``).
    OWN_RETURNED = "the loss the model's forward returns given targets (forward(tokens, targets))"
    OWN_NONE = ("the next-token cross-entropy of the logits the model's forward returns given targets (it "
                "returned no loss of its own)")
    LOGITS = "the next-token cross-entropy of the logits the model's forward returns (mean over tokens)"
    LOGITS_AUX = ("the next-token cross-entropy of the logits the model's forward returns (mean over tokens), plus "
                  "config.router_aux_loss_coef × the load-balancing loss it returns beside them (aux_loss), as "
                  "transformers' own loss adds it")


# Names a forward may take for its own targets that training does not pass (only ``targets``/``targets_BT``).
UNPASSED_TARGET_NAMES = ("labels", "target", "y")


def targets_not_passed(model: nn.Module) -> str | None:
    """What a user's forward takes for targets under another name than training passes, in one line,
    or None: a forward(input_ids, labels=None) that computes its own loss never got the labels, and its
    loss (its smoothing, its masks) was replaced by the cross-entropy of its logits without a word."""
    if loss_head_attached(model):  # transformers' causal LMs: their labels are handled (causal_lm_head)
        return None
    params = forward_parameters(model)
    if "targets" in params or "targets_BT" in params:
        return None
    named = next((n for n in UNPASSED_TARGET_NAMES if n in params), None)
    if named is None:
        return None
    return (f"{type(model).__name__}.forward takes {named!r}, which training does not pass: it trains the "
            "next-token cross-entropy of the logits the forward returns. For its own loss, name that argument "
            "'targets' (given the next tokens, -100 where a position is out of the loss)")


def parameters_not_float32(model: nn.Module, precision: str) -> str | None:
    """The model's floating parameters of other dtypes than float32, in one line, or None: a factory that
    returned ``.to(torch.bfloat16)`` trained in bf16 (its optimizer state too) while the report said fp32."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    other = {d: n for d, n in counts.items() if d != torch.float32}
    if not other:
        return None
    total = sum(counts.values())
    said = ", ".join(f"{n / total:.0%} {str(d).removeprefix('torch.')}" for d, n in sorted(
        other.items(), key=lambda kv: -kv[1]))
    return (f"the model's parameters are {said} (as it was built), not float32: they train in that dtype, and "
            f"the optimizer's state with them; train.precision = {precision} does not cast them (it sets autocast only)")


def loss_source(model: nn.Module) -> LossSource:
    params = forward_parameters(model)
    if loss_head_attached(model) or "targets_BT" in params:
        return LossSource.HEAD
    if "targets" in params:
        return LossSource.OWN
    return LossSource.LOGITS if router_aux_coef(model) is None else LossSource.LOGITS_AUX


def router_aux_coef(model: nn.Module) -> float | None:
    """The weight of the load-balancing loss of a transformers mixture of experts (Mixtral, Qwen2-MoE, ...)
    whose config asks for it (``output_router_logits``): its forward returns that loss as ``aux_loss``
    and, given labels, adds ``router_aux_loss_coef`` times it to the loss it computes. accelrun computes
    the cross-entropy itself, so it adds the same term; without it, a new user's Mixtral trained on
    cross-entropy alone, silently. None for any other model."""
    config = getattr(model, "config", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    if getattr(config, "output_router_logits", False) is not True or not isinstance(coef, (int, float)):
        return None
    return float(coef)


def _with_aux(loss_: torch.Tensor, out: Any, coef: float | None) -> torch.Tensor:
    aux = getattr(out, "aux_loss", None) if coef is not None else None
    return loss_ if aux is None else loss_ + coef * aux.to(loss_.device)


def training_loss_fn(model: nn.Module, vocab_size: int | None = None):
    """``(inputs, targets[, positions]) -> mean cross-entropy``: the model's own loss head when its forward
    takes targets (the built-in families: the head then compiles with ``compile.scope: loss`` or ``model``),
    otherwise cross-entropy over the logits it returns (``loss_source`` names which). ``positions``
    (document packing) is passed on as ``positions_BT`` only when given, so concat packing calls the
    model exactly as before. ``vocab_size``: the token ids the data may hold, which the logits a forward
    returns are checked against (``logits_of``)."""
    params = forward_parameters(model)
    if loss_head_attached(model):  # transformers' model with the head and loss as one step (causal_lm_head)
        def head_and_loss(inputs_BT, targets_BT):
            return model(inputs_BT, targets_BT=targets_BT)

        return head_and_loss
    if "targets_BT" in params:
        def own_loss(inputs_BT, targets_BT, positions_BT=None):
            if positions_BT is None:
                return model(inputs_BT, targets_BT)
            return model(inputs_BT, targets_BT, positions_BT=positions_BT)

        return own_loss

    # transformers' models fill a KV cache unless told not to (config.use_cache). Training never reads
    # it; it costs memory, and its per-layer state made Dynamo compile each decoder layer anew: a
    # 12-layer Llama hit Dynamo's recompile limit at 8 blocks and trained the other 4 eagerly.
    no_cache = {"use_cache": False} if "use_cache" in params else {}
    if "targets" in params:
        # nanoGPT's forward(idx, targets=None): only with targets does it return every position's logits
        # (and its own loss, the same cross-entropy, used as it is rather than computed twice).
        def with_targets(inputs_BT, targets_BT):
            nonlocal vocab_size
            try:
                out = model(inputs_BT, targets=targets_BT, **no_cache)
            except (IndexError, RuntimeError) as e:  # (a full traceback was all a trial's nanoGPT on chat data got)
                # eager's words, and a compiled graph's (its gather of the targets' log-probabilities)
                if any(f"{w} {IGNORE_INDEX} is out of bounds" in str(e) for w in ("Target", "index")):
                    raise ModelBuildError(
                        f"{type(model).__name__}.forward's own loss does not skip target {IGNORE_INDEX}, which "
                        "training gives where a position is out of the loss (a chat's turns not trained on, "
                        f"a document's first token): use ignore_index={IGNORE_INDEX} (cross_entropy's default) "
                        f"in its loss ({type(e).__name__}: {str(e).strip().splitlines()[0]})") from e
                raise
            own = loss_in(out)
            if model.training:  # (report.md) what training made of it: an evaluation's call may differ
                with_targets.trained = LossSource.OWN_RETURNED if own is not None else LossSource.OWN_NONE
            if own is not None:
                return own
            logits_BTV = logits_of(out, model, inputs_BT, vocab_size)
            vocab_size = None  # the classes checked once: they do not change between steps (it walks the modules)
            return next_token_loss(logits_BTV, targets_BT)

        return with_targets

    aux_coef = router_aux_coef(model)

    def loss(inputs_BT, targets_BT):
        nonlocal vocab_size
        out = model(inputs_BT, **no_cache)
        logits_BTV = logits_of(out, model, inputs_BT, vocab_size)
        vocab_size = None  # as above
        return _with_aux(next_token_loss(logits_BTV, targets_BT), out, aux_coef)

    return loss


def loss_in(output: Any) -> torch.Tensor | None:
    """The scalar loss a forward given targets returned: ``(logits, loss)``, ``.loss`` / ``["loss"]``, the
    loss alone, or ``(loss, logits)`` (transformers' order; the last two were read as logits of shape ())."""
    if _scalar(output):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and len(output) > 1:
        loss = output[0] if _scalar(output[0]) and not _scalar(output[1]) else output[1]
    return loss if _scalar(loss) else None


def _scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0


class ModelOutputError(UserError, TypeError):
    """A user's model returned something that holds no logits accelrun can read (exit 2)."""


def logits_of(output: Any, model: nn.Module, inputs_BT: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """The logits [batch, seq, vocab] in what a user's ``forward(inputs)`` returned, in the shapes models
    are written with: the tensor itself, a tuple or list led by it (nanoGPT's ``(logits, loss)``), or an
    object or dict with ``logits`` (transformers' outputs). With ``vocab_size`` (the token ids the data
    may hold), logits with fewer classes, or as many as the token table is wide (hidden states: the
    output head left out), are refused: the first crashed in the loss, the second trained without a word."""
    logits = output
    if not isinstance(logits, torch.Tensor):
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, dict):
            logits = output.get("logits")
        if logits is None and isinstance(output, (tuple, list)) and output:
            logits = output[0]
    forward = f"{type(model).__name__}.forward (model.custom)"
    if not isinstance(logits, torch.Tensor):
        got = (f"a dict with keys {sorted(map(str, output))}" if isinstance(output, dict) else
               f"a {type(output).__name__}" + (f" led by a {type(output[0]).__name__}"
                                               if isinstance(output, (tuple, list)) and output else ""))
        raise ModelOutputError(f"{forward} returned {got}; accelrun reads the logits [batch, seq, vocab] from a "
                               "tensor, a tuple or list whose first item is that tensor, or an object or dict "
                               "with 'logits'")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(inputs_BT.shape):
        raise ModelOutputError(f"{forward} returned logits of shape {tuple(logits.shape)} for inputs of shape "
                               f"{tuple(inputs_BT.shape)}; expected [batch, seq, vocab] = "
                               f"[{inputs_BT.shape[0]}, {inputs_BT.shape[1]}, vocab]")
    if vocab_size is not None:
        _check_classes(logits.shape[-1], vocab_size, model, forward)
    return logits


def _check_classes(classes: int, ids: int, model: nn.Module, forward: str) -> None:
    # More classes than token ids is a padded vocabulary (nanoGPT's 50,304 for 50,257), unless they are
    # as many as a token table is wide: then the forward most likely returned its hidden states. (A
    # hidden width equal to a padded vocabulary's would be refused too; none is known.)
    tables = [m for name, m in model.named_modules()  # (a position table's rows are no head's width)
              if isinstance(m, nn.Embedding) and m.num_embeddings >= ids and not is_position_table(name)]
    hidden = classes != ids and any(t.embedding_dim == classes for t in tables)
    if classes >= ids and not hidden:
        return
    # The head to suggest: as many outputs as the token table has rows (the smallest table that holds the ids)
    head = f"nn.Linear(dim, {min((t.num_embeddings for t in tables), default=ids)})"
    said = f"{forward} returned logits with {classes} classes (their last dimension) for token ids 0 to {ids - 1}"
    if hidden:
        raise ModelOutputError(f"{said}: {classes} is the width of its token table (nn.Embedding), so these look "
                               f"like hidden states; apply the output head ({head}) in forward")
    raise ModelOutputError(f"{said}: the loss needs a class per token id, at least {ids} (an output head {head})")

"""What a graph pass is, and the registry that names them.

A pass is a plain function ``(gm, options, ctx) -> PassResult`` that rewrites ``gm`` in place (or
returns a new module in ``PassResult.graph``). It is registered once under a name, with a pydantic
model of its options, and runs at one *stage* of compilation:

- ``pre_grad``: the Dynamo graph (torch-level calls, before AOTAutograd). Pattern fusion lives here:
  replacing a pattern with a custom op whose autograd formula is registered fuses forward and backward.
- ``partition``: the joint forward+backward ATen graph being split; the function gets the
  ``(forward, backward)`` pair as ``gm`` and returns the new pair in ``PassResult.graph``
  (rematerialisation decides here what the backward recomputes instead of reading from saved memory).
- ``post_grad``: the forward and the backward ATen graphs, each on its own (clean-up, region
  partitioning, communication scheduling).

Recipes name passes (``compile.passes``) by their registered name; a preset names a whole list.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

Stage = Literal["pre_grad", "partition", "post_grad"]
STAGES: tuple[Stage, ...] = ("pre_grad", "partition", "post_grad")


class PassOptions(BaseModel):
    """Base of every pass's options: unknown keys are errors, like everywhere in a recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class PassContext:
    """What a pass may want to know besides the graph."""

    graph_kind: Literal["pre_grad", "forward", "backward", "joint"]
    # Tensors (real or fake) with the shapes of the graph's placeholders, in order; None if unknown.
    example_inputs: list[Any] | None = None
    # Free-form facts a pass leaves for later passes (e.g. which nodes form a region).
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassResult:
    changed: bool
    summary: str = ""  # one line for `compile explain`: "removed 3 nodes", "matched 4 RMSNorm"
    counts: dict[str, int] = field(default_factory=dict)  # machine-readable facts for the report
    graph: Any = None  # a replacement graph module (or (forward, backward) pair at the partition stage)
    detail: str = ""  # several lines for `compile explain` (e.g. the collectives' schedule before and after)


PassFn = Callable[[Any, Any, PassContext], PassResult]


@dataclass(frozen=True)
class PassSpec:
    name: str
    stage: Stage
    fn: PassFn
    options: type[PassOptions]
    doc: str


_REGISTRY: dict[str, PassSpec] = {}


def register_pass(name: str, stage: Stage, options: type[PassOptions] = PassOptions):
    """Decorator: ``@register_pass("dce", "post_grad")`` on a pass function."""
    if stage not in STAGES:
        raise ValueError(f"pass {name!r}: stage must be one of {STAGES}, got {stage!r}")

    def wrap(fn: PassFn) -> PassFn:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"two passes registered under the name {name!r}")
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        _REGISTRY[name] = PassSpec(name, stage, fn, options, doc)
        return fn

    return wrap


def _load_builtin_passes() -> None:
    # Importing the package registers every built-in pass (each module decorates its function).
    import accelrun.compile.passes  # noqa: F401


def registered_passes() -> dict[str, PassSpec]:
    _load_builtin_passes()
    return dict(_REGISTRY)


# Presets name ordered lists. Order matters within a stage only; stages always run in STAGES order.
PRESETS: dict[str, list[str]] = {
    "none": [],
    "default": [
        "fuse_attention", "fuse_rmsnorm", "fuse_swiglu", "fuse_rope", "fuse_linear_cross_entropy",
        "merge_parallel_linears", "dce", "cse", "partition_regions",
    ],
    "max": [
        "fuse_attention", "fuse_rmsnorm", "fuse_swiglu", "fuse_rope", "fuse_linear_cross_entropy",
        "merge_parallel_linears", "remat", "dce", "cse", "bucket_collectives", "schedule_overlap", "partition_regions",
    ],
    # default + the communication passes (for compiled FSDP / TP graphs; a no-op without collectives).
    "overlap": [
        "fuse_attention", "fuse_rmsnorm", "fuse_swiglu", "fuse_rope", "fuse_linear_cross_entropy",
        "merge_parallel_linears", "dce", "cse", "bucket_collectives", "schedule_overlap", "partition_regions",
    ],
}  # fmt: skip


@dataclass(frozen=True)
class ConfiguredPass:
    spec: PassSpec
    options: PassOptions

    @property
    def name(self) -> str:
        return self.spec.name


class PassConfigError(ValueError):
    """A recipe's ``compile.passes`` names an unknown pass or gives it bad options.

    ``index`` is the list position (None for a preset name) so the caller can point at the line.
    """

    def __init__(self, message: str, index: int | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.key = key


def _nearest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def resolve_passes(spec: str | list[Any]) -> list[ConfiguredPass]:
    """A preset name, or a list of names / ``{name: options}`` / ``{name: ..., opt: ...}`` items."""
    registry = registered_passes()
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise PassConfigError(
                f"unknown pass preset {spec!r}{_nearest(spec, list(PRESETS))}; presets: {', '.join(PRESETS)}"
            )
        items: list[Any] = list(PRESETS[spec])
    else:
        items = list(spec)
    out: list[ConfiguredPass] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        name, raw = _split_item(item, i)
        if name in PRESETS and name not in registry:
            raise PassConfigError(f"preset {name!r} cannot appear inside a list of passes", i)
        if name not in registry:
            raise PassConfigError(
                f"unknown pass {name!r}{_nearest(name, sorted(registry))}; passes: {', '.join(sorted(registry))}",
                i,
            )
        if name in seen:
            raise PassConfigError(f"pass {name!r} is listed twice", i)
        seen.add(name)
        pspec = registry[name]
        try:
            options = pspec.options(**raw)
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            fields = sorted(pspec.options.model_fields)
            hint = _nearest(key, fields) if err["type"] == "extra_forbidden" else ""
            allowed = f"; options of {name}: {', '.join(fields) or '(none)'}"
            raise PassConfigError(f"pass {name!r}, option {key!r}: {err['msg']}{hint}{allowed}", i, key) from None
        out.append(ConfiguredPass(pspec, options))
    return out


def _split_item(item: Any, index: int) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if isinstance(item, dict):
        if "name" in item:
            rest = {k: v for k, v in item.items() if k != "name"}
            return str(item["name"]), rest
        if len(item) == 1:
            (name, opts), = item.items()
            if opts is None:
                return str(name), {}
            if isinstance(opts, dict):
                return str(name), dict(opts)
    raise PassConfigError(
        "each pass is a name (`- dce`), `{name: remat, budget_mb: 64}`, or `{remat: {budget_mb: 64}}`; "
        f"got {item!r}",
        index,
    )


def passes_for_stage(passes: list[ConfiguredPass], stage: Stage) -> list[ConfiguredPass]:
    return [p for p in passes if p.spec.stage == stage]


def lint(gm: torch.fx.GraphModule) -> None:
    """Raise if a pass left a malformed graph (dangling uses, bad order, missing output)."""
    gm.graph.lint()
    if not any(n.op == "output" for n in gm.graph.nodes):
        raise AssertionError("graph has no output node")

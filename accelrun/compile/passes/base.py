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

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

# Names, stages, option schemas and presets live in config (torch-free, read by `accelrun validate`).
from accelrun.config.compile_names import (  # noqa: F401  (re-exported)
    BUILTIN_PASSES,
    PRESETS,
    STAGES,
    PassConfigError,
    PassOptions,
    Stage,
    parse_passes,
)


@dataclass
class GraphNotes:
    """Facts about one Dynamo graph that outlive a pass. The backend makes one per Dynamo graph and
    hands the same object to every pass of every stage (pre-grad, joint, partition, forward, backward),
    so what one pass or stage learns reaches the later ones."""

    # How many of the forward graph's outputs are the function's own (AOTAutograd's count, given to its
    # partitioner); the rest are saved for the backward. None until the partition stage, or when a
    # pass runs outside the backend.
    num_fwd_outputs: int | None = None
    # The next free fusion region id: partition_regions numbers its regions from here and advances it,
    # so the forward's and the backward's regions never share an id.
    next_region_id: int = 0
    # The forward's inputs that live all along (parameters and buffers: AOTAutograd's
    # static_lifetime_input_indices, its own numbering of the forward's inputs, known at the partition
    # stage). None: unknown.
    static_inputs: frozenset[int] | None = None


@dataclass
class PassContext:
    """What a pass may want to know besides the graph."""

    graph_kind: Literal["pre_grad", "forward", "backward", "joint"]
    # Tensors (real or fake) with the shapes of the graph's placeholders, in order; None if unknown.
    example_inputs: list[Any] | None = None
    # Shared by every pass run on the same Dynamo graph (see GraphNotes); a fresh one outside the backend.
    notes: GraphNotes = field(default_factory=GraphNotes)


@dataclass
class PassResult:
    changed: bool
    summary: str = ""  # one line for `compile explain`: "removed 3 nodes", "matched 4 RMSNorm"
    counts: dict[str, int] = field(default_factory=dict)  # machine-readable facts for the report
    graph: Any = None  # a replacement graph module (or (forward, backward) pair at the partition stage)
    detail: str = ""  # several lines for `compile explain` (e.g. the collectives' schedule before and after)


def rewrites_result(gm: Any, rewritten: int, kept: dict[str, int], done: str) -> PassResult:
    """The result of a pass that rewrote ``rewritten`` calls in ``gm`` (its code regenerated) and left
    ``kept`` (reason -> count) to ATen: ``f"{rewritten} {done}"``, then each reason."""
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    left = "; ".join(f"{n} left to ATen ({why})" for why, n in sorted(kept.items()))
    return PassResult(changed=rewritten > 0, summary=f"{rewritten} {done}" + (f"; {left}" if left else ""),
                      counts={"rewritten": rewritten, "kept": sum(kept.values())})  # fmt: skip


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
    if name in BUILTIN_PASSES and BUILTIN_PASSES[name] != (stage, options):
        declared = BUILTIN_PASSES[name]
        raise ValueError(f"pass {name!r} is declared in accelrun.config.compile_names as {declared[0]} with "
                         f"{declared[1].__name__}; registered as {stage} with {options.__name__}")

    def wrap(fn: PassFn) -> PassFn:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"two passes registered under the name {name!r}")
        doc = first_sentence(fn.__doc__ or "")
        _REGISTRY[name] = PassSpec(name, stage, fn, options, doc)
        return fn

    return wrap


def _load_builtin_passes() -> None:
    # Importing the package registers every built-in pass (each module decorates its function).
    import accelrun.compile.passes  # noqa: F401


def registered_passes() -> dict[str, PassSpec]:
    _load_builtin_passes()
    return dict(_REGISTRY)


@dataclass(frozen=True)
class ConfiguredPass:
    spec: PassSpec
    options: PassOptions

    @property
    def name(self) -> str:
        return self.spec.name


def resolve_passes(spec: str | list[Any]) -> list[ConfiguredPass]:
    """A preset name, or a list of names / ``{name: options}`` / ``{name: ..., opt: ...}`` items."""
    registry = registered_passes()
    parsed = parse_passes(spec, {name: pspec.options for name, pspec in registry.items()})
    return [ConfiguredPass(registry[name], options) for name, options in parsed]


def passes_for_stage(passes: list[ConfiguredPass], stage: Stage) -> list[ConfiguredPass]:
    return [p for p in passes if p.spec.stage == stage]


def lint(gm: torch.fx.GraphModule) -> None:
    """Raise if a pass left a malformed graph (dangling uses, bad order, missing output)."""
    gm.graph.lint()
    if not any(n.op == "output" for n in gm.graph.nodes):
        raise AssertionError("graph has no output node")


def first_sentence(doc: str) -> str:
    """A docstring's first sentence, across its lines (its first line alone stopped mid-sentence in
    `accelrun compile passes`: "...instead of its output (cross-entropy's); the")."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", paragraph)
    return paragraph[:end.start() + 1] if end else paragraph

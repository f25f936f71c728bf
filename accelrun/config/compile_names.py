"""The compiler's names as a recipe sees them: passes, their stages and option schemas, presets, executors.

Torch-free, so that ``accelrun validate`` checks ``compile.passes`` and ``compile.executors`` without
importing the compiler (config is the bottom layer). The compiler reads from here:
``accelrun.compile.passes.base.register_pass`` refuses a built-in name registered with another stage
or another options class, and each pass module imports its options class from this module. A new
built-in pass is declared here (name, stage, options) and implemented in ``compile/passes/``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError

# joint: the forward and backward in one graph, before they are cut apart (what is saved is decided
# there); partition: the (forward, backward) pair after the cut.
Stage = Literal["pre_grad", "joint", "partition", "post_grad"]
STAGES: tuple[Stage, ...] = ("pre_grad", "joint", "partition", "post_grad")


class PassOptions(BaseModel):
    """Base of every pass's options: unknown keys are errors, like everywhere in a recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class FuseAttentionOptions(PassOptions):
    # Evaluate constant masks at compile time to recognise the causal one (then no mask tensor is kept).
    detect_causal: bool = True


class FuseRMSNormOptions(PassOptions):
    pass


class FuseSwiGLUOptions(PassOptions):
    pass


class FuseRopeOptions(PassOptions):
    pass


class FuseLinearCrossEntropyOptions(PassOptions):
    # Rows per chunk; when unset, as many rows as keep one chunk's fp32 logits under chunk_mb.
    chunk_rows: PositiveInt | None = None
    chunk_mb: PositiveFloat = 256.0


class MergeParallelLinearsOptions(PassOptions):
    pass


class RematOptions(PassOptions):
    budget_mb: float | None = Field(
        None, ge=0, description="saved-activation budget in MiB; None: recompute every cheap candidate"
    )
    recompute: list[Literal["pointwise", "view", "reduction"]] = Field(
        default_factory=lambda: ["pointwise", "view"], description="op kinds cheap enough to recompute"
    )
    max_chain: int = Field(16, ge=1, description="most nodes recomputed for one saved value")


class PartitionRegionsOptions(PassOptions):
    max_nodes: int = Field(64, ge=1, description="most nodes (views included) in one region")
    min_ops: int = Field(2, ge=1, description="regions with fewer pointwise/reduction ops stay unmarked")


class CpuGemmOptions(PassOptions):
    # tuned: each fp32 product's layout timed on this machine, ATen (MKL) against oneDNN, once, then cached;
    # onednn / aten: every eligible product to that library, untimed.
    library: Literal["tuned", "onednn", "aten"] = "tuned"


class BucketOptions(PassOptions):
    bucket_mb: float = 25.0  # bytes of inputs per bucket, at most (a larger collective stays alone)


class ScheduleOptions(PassOptions):
    max_inflight_mb: float = 256.0  # input + output bytes of collectives issued and not yet waited


# name → (stage, options): every built-in pass (compile/passes/<name>.py registers each under its name).
BUILTIN_PASSES: dict[str, tuple[Stage, type[PassOptions]]] = {
    "dce": ("post_grad", PassOptions),
    "cse": ("post_grad", PassOptions),
    "simplify": ("post_grad", PassOptions),
    "cpu_half_gemm": ("post_grad", PassOptions),
    "cpu_gemm": ("post_grad", CpuGemmOptions),
    "cpu_dropout": ("post_grad", PassOptions),
    "cpu_depthwise_conv": ("post_grad", PassOptions),
    "reinplace": ("post_grad", PassOptions),
    "fuse_attention": ("pre_grad", FuseAttentionOptions),
    "cpu_attention": ("pre_grad", PassOptions),
    "fuse_rmsnorm": ("pre_grad", FuseRMSNormOptions),
    "fuse_swiglu": ("pre_grad", FuseSwiGLUOptions),
    "fuse_rope": ("pre_grad", FuseRopeOptions),
    "fuse_linear_cross_entropy": ("pre_grad", FuseLinearCrossEntropyOptions),
    "merge_parallel_linears": ("pre_grad", MergeParallelLinearsOptions),
    "loss_row_stats": ("joint", PassOptions),
    "remat": ("partition", RematOptions),
    "partition_regions": ("post_grad", PartitionRegionsOptions),
    "bucket_collectives": ("post_grad", BucketOptions),
    "schedule_overlap": ("post_grad", ScheduleOptions),
}

# Built-in executors, in the order compile/executors/ registers them.
BUILTIN_EXECUTORS: tuple[str, ...] = ("aten", "inductor", "cpp", "triton")

# Presets name ordered lists. Order matters within a stage only; stages always run in STAGES order.
# remat is in the default since 2026-12-06: transformers' GPT-2's step memory 498 -> 261 MiB (Inductor's
# 445), the debug Llama's peak 724 -> 680 MiB, at the same speed within the noise (docs/compiler.md).
_DEFAULT_PASSES = [
    "fuse_attention", "cpu_attention", "fuse_rmsnorm", "fuse_swiglu", "fuse_rope", "fuse_linear_cross_entropy",
    "merge_parallel_linears", "loss_row_stats", "remat", "dce", "cse", "simplify", "cpu_half_gemm", "cpu_gemm",
    "cpu_dropout", "cpu_depthwise_conv", "reinplace", "partition_regions",
]  # fmt: skip
# The default and the communication passes (for compiled FSDP / TP graphs; a no-op without collectives),
# before the regions are drawn: every pass there is.
_WITH_COMMUNICATION = [*_DEFAULT_PASSES[:-1], "bucket_collectives", "schedule_overlap", _DEFAULT_PASSES[-1]]
PRESETS: dict[str, list[str]] = {
    "none": [],
    "default": list(_DEFAULT_PASSES),
    "max": list(_WITH_COMMUNICATION),
    "overlap": list(_WITH_COMMUNICATION),
}


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


def preset_passes(spec: str) -> list[str]:
    """The passes a preset names, less those it is written without: ``default``, ``default-remat``,
    ``max-remat-cpu_dropout`` (a pass's name has no hyphen). Leaving one pass out took the whole list."""
    preset, *left_out = spec.split("-")
    if preset not in PRESETS:
        raise PassConfigError(
            f"unknown pass preset {preset!r}{_nearest(preset, list(PRESETS))}; presets: {', '.join(PRESETS)}, "
            "each less any of its passes (default-remat)"
        )
    names = list(PRESETS[preset])
    for i, name in enumerate(left_out):
        if name in left_out[:i]:
            raise PassConfigError(f"{spec!r} leaves {name!r} out twice")
        if name not in names:
            raise PassConfigError(f"{name!r} is not a pass of the {preset!r} preset{_nearest(name, names)}; "
                                  f"its passes: {', '.join(PRESETS[preset]) or '(none)'}")  # fmt: skip
        names.remove(name)
    return names


def parse_passes(spec: str | list[Any], options_by_name: Mapping[str, type[PassOptions]] | None = None
                 ) -> list[tuple[str, PassOptions]]:
    """A preset name, or a list of names / ``{name: options}`` / ``{name: ..., opt: ...}`` items, as
    (name, validated options) pairs. ``options_by_name`` is the passes that exist (default: the built-ins;
    the compiler passes its registry, which may hold passes registered at run time)."""
    known = options_by_name if options_by_name is not None else {n: o for n, (_, o) in BUILTIN_PASSES.items()}
    items: list[Any] = preset_passes(spec) if isinstance(spec, str) else list(spec)
    out: list[tuple[str, PassOptions]] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        name, raw = _split_item(item, i)
        if name in PRESETS and name not in known:
            raise PassConfigError(f"preset {name!r} cannot appear inside a list of passes", i)
        if name not in known:
            raise PassConfigError(
                f"unknown pass {name!r}{_nearest(name, sorted(known))}; passes: {', '.join(sorted(known))}", i,
            )
        if name in seen:
            raise PassConfigError(f"pass {name!r} is listed twice", i)
        seen.add(name)
        schema = known[name]
        try:
            options = schema(**raw)
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            fields = sorted(schema.model_fields)
            hint = _nearest(key, fields) if err["type"] == "extra_forbidden" else ""
            allowed = f"; options of {name}: {', '.join(fields) or '(none)'}"
            # (pydantic's "Extra inputs are not permitted" for a misspelt option: a trial's)
            said = f"unknown option{hint}" if err["type"] == "extra_forbidden" else _lower_first(err["msg"])
            raise PassConfigError(f"pass {name!r}, option {key!r}: {said}{allowed}", i, key) from None
        out.append((name, options))
    return out


def pass_names(spec: str | list[Any]) -> list[str]:
    """The names a preset or list of passes holds, options not validated and passes registered at run
    time included; an item that is not a pass at all is left out (parse_passes reports it)."""
    if isinstance(spec, str):
        try:
            return preset_passes(spec)
        except PassConfigError:
            return []
    items, names = list(spec), []
    for i, item in enumerate(items):
        try:
            names.append(_split_item(item, i)[0])
        except PassConfigError:
            continue
    return names


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


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]

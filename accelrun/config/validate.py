"""Turn a composed mapping into a ``RunConfig``, or into messages that point at file and line.

Two stages: pydantic checks each value on its own (types, ranges, unknown keys); then
``consistency_problems`` checks values against each other (dim divisible by heads, batch
divisible by micro-batch × data-parallel degree, ...). Every message names the keys involved
and where each was set.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from accelrun.config.chat_template_file import chat_problems
from accelrun.config.compile_names import BUILTIN_EXECUTORS, PassConfigError, parse_passes
from accelrun.config.compose import DEFAULT, Source
from accelrun.config.data_checks import DATA_KEYS_USED_BY, PATH_SOURCES_HINT, data_problems, mix_warnings
from accelrun.config.errors import SYNONYMS, ConfigError, nearest
from accelrun.config.moe_checks import moe_problems, moe_warnings
from accelrun.config.record_paths import path_matches
from accelrun.config.schema import FAMILY_ONLY_KEYS, INTERLEAVED_SCHEDULES, ModelConfig, RunConfig
from accelrun.config.search import search_path
from accelrun.config.tokenizer_file import (
    BYTE_VOCAB,
    stored_tokenizer,
    tokenizer_problems,
    tokenizer_warnings,
)
from accelrun.config.yaml_lines import KeyPath, dotted

# Token ids the built-in tokenizers use (accelrun.data.tokenizer is the source of truth;
# a test keeps the two in step so that `validate` needs no torch import).
TOKENIZER_VOCAB = {"byte": BYTE_VOCAB}
PARALLEL_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


# Families whose head dimension is a key of its own (model.head_dim); the others' is dim / n_heads.
HEAD_DIM_FAMILIES = ("gemma",)

# Values written for a choice under another name (``data.source: jsonl``), by the key's last name; a
# similarity ratio finds none of them.
CHOICE_SYNONYMS = {
    "source": {**dict.fromkeys(("jsonl", "ndjson", "json", "csv", "parquet", "arrow", "records"), "documents"),
               "txt": "text", "tok": "tokens"},
}


def validate(data: dict[str, Any], sources: dict[KeyPath, Source], duplicate_keys: Sequence[str] = ()) -> RunConfig:
    """The recipe as a RunConfig, or one ConfigError listing every problem: ``duplicate_keys`` (the
    files' keys set twice, found while reading them) first, then the schema's or the consistency checks'."""
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        errors = _without_misspelt_required(e.errors(), data)
        raise ConfigError(in_file_order([*duplicate_keys, *(_describe(err, data, sources) for err in errors)])) from None
    problems = in_file_order([*duplicate_keys, *consistency_problems(cfg, sources)])
    if problems:
        raise ConfigError(problems)
    if cfg.train.micro_batch is None:  # checked above: global_batch divides by grad_accum × dp
        cfg.train.micro_batch = cfg.train.global_batch // ((cfg.train.grad_accum or 1) * cfg.parallel.dp)
    # Stored as an absolute path (hf: the model.hf folder): ranks, generate and export find the same file.
    cfg.data.tokenizer = stored_tokenizer(cfg.data.tokenizer, cfg.model.hf)
    return cfg


_WHERE = re.compile(r"^(?P<file>[^\s:]+):(?P<line>\d+)\b")


def in_file_order(messages: list[str]) -> list[str]:
    """Messages that begin with ``file:line`` sorted by file (in the order the files first appear) and
    line, as a compiler lists its diagnostics; the others after them, in their own order (the schema's
    order read 5, 4, 3, 7 down a file; found by a new user)."""
    files: dict[str, int] = {}

    def key(message: str) -> tuple[int, int, int]:
        m = _WHERE.match(message)
        if m is None:
            return (1, 0, 0)
        return (0, files.setdefault(m["file"], len(files)), int(m["line"]))

    return sorted(messages, key=key)


def source_of(path: KeyPath, sources: dict[KeyPath, Source], *, exact: bool = True) -> Source:
    """Who set ``path`` (the schema default if nobody did).

    With ``exact=False``, a path nobody set reports its nearest ancestor that was set: that is
    where an error about a key missing from a mapping should point.
    """
    if path in sources or exact:
        return sources.get(path, DEFAULT)
    for i in range(len(path) - 1, 0, -1):
        if path[:i] in sources:
            return sources[path[:i]]
    return DEFAULT


def _without_misspelt_required(errors: list, data: dict) -> list:
    """A misspelt required key (``wieght`` for ``weight``) is one mistake, not two: drop the "field
    required" error whose key an unknown key beside it is a near spelling of (that error says both)."""
    meant: set[KeyPath] = set()
    for err in errors:
        if err["type"] == "extra_forbidden":
            path = _data_path(err["loc"], data)
            if hint := nearest(str(path[-1]), _fields_at(path[:-1])):
                meant.add(path[:-1] + (hint,))
    return [err for err in errors if not (err["type"] == "missing" and _data_path(err["loc"], data) in meant)]


def _describe(err: dict, data: dict, sources: dict[KeyPath, Source]) -> str:
    path = _data_path(err["loc"], data)
    where = source_of(path, sources, exact=False)
    prefix = "" if where.kind == "default" else f"{where}: "
    key = dotted(path)
    if err["type"] == "extra_forbidden":
        valid = _fields_at(path[:-1])
        hint = nearest(str(path[-1]), valid)
        msg = f"{prefix}unknown key '{key}'"
        if moved := _same_name_below(path[:-1], str(path[-1])):  # train.lr: train.optimizer.lr
            msg += f"; did you mean '{dotted(moved)}'?"
        elif hint:
            msg += f"; did you mean '{dotted(path[:-1] + (hint,))}'?"
        section = dotted(path[:-1]) or "the top level"
        return msg + f" (valid keys in {section}: {', '.join(valid)})"
    got = err.get("input")
    # Our own validators' messages (a ValueError) come as "Value error, ...": the message is ours alone.
    text = err["msg"].removeprefix("Value error, ") if err["type"] == "value_error" else err["msg"]
    if err["type"] == "string_pattern_mismatch" and path == ("name",) and isinstance(got, str):
        # (pydantic's words were its regex: a trial's)
        fixed = re.sub(r"[^A-Za-z0-9._-]+", "-", got).strip("-._") or "my-run"
        return (f"{prefix}name: {got!r} cannot name a run's folder: letters, digits, '.', '_' and '-', starting "
                f"with a letter or digit; name={fixed}")
    if err["type"] == "model_type":  # pydantic names its class ("... instance of TrainConfig"): say what it holds
        keys = _fields_at(path)
        text = f"expected a section of keys ({', '.join(keys[:6])}{', ...' if len(keys) > 6 else ''}), not a value"
    msg = f"{prefix}{key}: {_lower_first(text)}"
    beyond = err["loc"][len(path):]
    if err["type"] == "missing" and beyond and isinstance(beyond[0], int):
        return f"{prefix}{key}: item {beyond[0]} is missing (got {got!r} with fewer items)"
    if err["type"] == "literal_error" and isinstance(got, str):
        choices = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        hint = nearest(got, choices) or CHOICE_SYNONYMS.get(str(path[-1]), {}).get(got.lower())
        if hint:
            msg += f"; did you mean '{hint}'?"
    if err["type"] != "missing" and not isinstance(got, dict) and not (
            err["type"] == "value_error" and (repr(got) in text or isinstance(got, bool))):  # said already
        msg += f" (got {got!r})"
    if err["type"] in SEQUENCE_ERRORS and not beyond[1:]:
        msg += f"; {_sequence_spelling(path, got, where)}"
    if err["type"] == "model_type" and isinstance(got, str) and "name" in _fields_at(path):  # train.optimizer=adamw
        msg += f"; did you mean '{key}.name={got}'?"
    if (err["type"] in BOUND_ERRORS and isinstance(got, int | float) and got <= 0 and len(path) > 1
            and path[-1] == "every" and "enabled" in _fields_at(path[:-1])):  # fmt: skip
        # checkpoint.every=0 is how other tools turn checkpoints off (not a request to save at every step)
        msg += f"; to switch {dotted(path[:-1])} off: {dotted(path[:-1] + ('enabled',))}=false"
    elif (near := _nearest_whole_number(path, got, err["type"])) is not None:
        msg += f"; the nearest valid value is {near}"
    return msg


# Pydantic's error types for a number beyond a field's bounds, and for a fraction where a whole number is wanted.
BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
WHOLE_NUMBER_ERRORS = ("int_from_float",)


def _nearest_whole_number(path: KeyPath, got: Any, error_type: str) -> int | None:
    """For a whole-number key given a number it refuses (``train.steps=-3``, ``report.log_every=0.5``):
    the valid value nearest to it, within the key's bounds. None for any other error or key."""
    field = _field_at(path)
    if (error_type not in (*BOUND_ERRORS, *WHOLE_NUMBER_ERRORS) or field is None or field.annotation is not int
            or isinstance(got, bool) or not isinstance(got, int | float)):  # fmt: skip
        return None
    value = math.floor(got + 0.5)  # halves up: round() takes 2.5 to 2 and 3.5 to 4
    for bound in field.metadata:  # annotated_types' Gt, Ge, Lt, Le
        if (gt := getattr(bound, "gt", None)) is not None:
            value = max(value, gt + 1)
        if (ge := getattr(bound, "ge", None)) is not None:
            value = max(value, ge)
        if (lt := getattr(bound, "lt", None)) is not None:
            value = min(value, lt - 1)
        if (le := getattr(bound, "le", None)) is not None:
            value = min(value, le)
    return int(value)


# Pydantic's error types for a value that is not a list or tuple at all (not an item's error).
SEQUENCE_ERRORS = ("list_type", "tuple_type")


def _sequence_spelling(path: KeyPath, got: Any, where: Source) -> str:
    """The spelling that works for a list or tuple, in the form the user wrote it (an override on the
    command line, or a line in a file): ``0.9,0.95`` is one string to YAML, ``[0.9, 0.95]`` a list."""
    items = [p.strip() for p in got.split(",")] if isinstance(got, str) else [str(got)]
    field = _field_at(path)
    default = None if field is None else field.get_default(call_default_factory=True)
    arity = _tuple_arity(field.annotation) if field is not None else 0
    if len(items) < arity:  # one value for a pair: show the whole shape (the defaults, or the value again)
        items = [str(x) for x in default] if isinstance(default, tuple) and len(default) == arity else \
            items + [items[-1]] * (arity - len(items))
    flow = f"[{', '.join(items)}]"
    if where.kind == "override":  # quoted: the space after the comma would split the shell word
        return f"write it in brackets, quoted for the shell: '{dotted(path)}={flow}'"
    return f"write it in brackets: {path[-1]}: {flow}"


def _tuple_arity(annotation: Any) -> int:
    """Items of a fixed-length tuple annotation (``tuple[int, int] | None``: 2); 0 for anything else."""
    if get_origin(annotation) is tuple:
        args = get_args(annotation)
        return 0 if Ellipsis in args else len(args)
    return max((_tuple_arity(a) for a in get_args(annotation)), default=0)  # a union: its tuple member


def _field_at(path: KeyPath) -> FieldInfo | None:
    model: type[BaseModel] = RunConfig
    for part in path[:-1]:
        ann = getattr(model.model_fields.get(str(part)), "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model.model_fields.get(str(path[-1]))


def _data_path(loc: tuple, data: Any) -> KeyPath:
    """Pydantic locations may carry union-member tags; keep the part that names real keys."""
    path: list = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list | tuple) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            # In a mapping a missing or unknown key still names itself; below a leaf value the rest
            # are pydantic's names for union members ("constrained-float"), not keys.
            if isinstance(node, dict) and isinstance(part, str):
                path.append(part)
            break
        path.append(part)
    return tuple(path)


def _fields_at(path: KeyPath) -> list[str]:
    """The keys of the section at ``path`` (the top level for ``()``), or none where it is no section."""
    section = _section_type(_annotation_at(path)) if path else RunConfig
    return list(section.model_fields) if section is not None else []


def _same_name_below(section: KeyPath, name: str) -> KeyPath | None:
    """The key named ``name`` one section further down from ``section`` (``train.lr`` is
    ``train.optimizer.lr``; ``train.warmup_steps`` is ``train.lr_schedule.warmup_steps``), when exactly one
    such key exists."""
    if not section:  # a top-level warmup_steps could mean train's or report's: nearest() says no more
        return None
    name = SYNONYMS.get(name.lower(), name)  # train.learning_rate: train.optimizer.lr
    found = [section + (sub, name) for sub in _fields_at(section)
             if name in _fields_at(section + (sub,))
             and get_origin(annotation := _annotation_at(section + (sub,))) is not list  # data.mix's items: no key
             and _section_type(annotation)]
    return found[0] if len(found) == 1 else None


def _annotation_at(path: KeyPath) -> Any:
    """The type annotation of the key at ``path`` (a non-empty one), None past a value that is no section.
    An index (``data.mix.1``) stands for an item of the list of sections named before it."""
    model: type[BaseModel] | None = RunConfig
    annotation: Any = None
    for part in path:
        if isinstance(part, int):
            continue
        if model is None:
            return None
        annotation = getattr(model.model_fields.get(str(part)), "annotation", None)
        model = _section_type(annotation)
    return annotation


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds: itself, the item type of a list of sections (data.mix), or an optional
    section's (model.rope_scaling: ``RopeScalingConfig | None``)."""
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    if len(present := [a for a in get_args(annotation) if a is not type(None)]) == 1:  # X | None
        annotation = present[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:]


def consistency_problems(cfg: RunConfig, sources: dict[KeyPath, Source]) -> list[str]:
    """Checks across fields; each message names every key involved and where it was set."""

    def v(path: str) -> str:
        parts = tuple(path.split("."))
        value: Any = cfg
        for p in parts:
            value = getattr(value, p)
        return f"{path} = {value} ({source_of(parts, sources)})"

    out: list[str] = []
    m, t = cfg.model, cfg.train
    if m.custom is None and m.kwargs:
        out.append(f"model.kwargs ({source_of(('model', 'kwargs'), sources)}) is only used with model.custom")
    if m.custom is not None and cfg.checkpoint.hf_on_finish:
        # found by a new user: the whole run trained, then the export refused it (exit 2, no end line)
        out.append(f"{v('checkpoint.hf_on_finish')} exports a built-in model family as a transformers folder at the "
                   f"end of training, not {v('model.custom')}: set checkpoint.hf_on_finish=false (`accelrun export "
                   "<run> --hf <folder>` writes a model.custom that is a transformers model, with its save_pretrained)")
    if m.custom is None:
        if m.head_dim is not None and m.arch not in HEAD_DIM_FAMILIES:
            out.append(f"{v('model.head_dim')} is only read by model.arch {' / '.join(HEAD_DIM_FAMILIES)}; "
                       f"{v('model.arch')} uses model.dim / model.n_heads")
        elif m.head_dim is not None:
            if m.head_dim % 2:
                out.append(f"{v('model.head_dim')} must be even for RoPE")
        elif m.dim % m.n_heads:  # (with the nearest values that fit: a trial's dim=190 was told no more)
            step = 2 * m.n_heads  # an even head dimension, for RoPE
            heads = _nearest(m.n_heads, [h for h in range(1, m.dim + 1) if m.dim % h == 0 and (m.dim // h) % 2 == 0
                                         and (m.n_kv_heads is None or h % m.n_kv_heads == 0)])
            also = f" or model.n_heads={heads}" if heads else ""
            out.append(f"{v('model.dim')} is not divisible by {v('model.n_heads')}; model.dim="
                       f"{max(step, round(m.dim / step) * step)} (a multiple of {step}: an even head dimension){also}")
        elif (m.dim // m.n_heads) % 2:
            out.append(f"head dimension model.dim / model.n_heads = {m.dim // m.n_heads} must be even for RoPE")
        if m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
            kv = _nearest(m.n_kv_heads, [k for k in range(1, m.n_heads + 1) if m.n_heads % k == 0])
            out.append(f"{v('model.n_heads')} is not divisible by {v('model.n_kv_heads')}; model.n_kv_heads={kv} "
                       f"divides it")
        if t.seq_len > m.max_seq_len:
            out.append(f"{v('train.seq_len')} exceeds {v('model.max_seq_len')}")
    out += tokenizer_problems(cfg, v)
    out += chat_problems(cfg, v)
    if cfg.data.paths and cfg.data.source in ("builtin", "synthetic"):
        out.append(f"data.paths is set but {v('data.source')} reads no files: {PATH_SOURCES_HINT}")
    elif not cfg.data.paths and cfg.data.source in ("text", "tokens") and not cfg.data.mix:
        out.append(f"{v('data.source')} needs data.paths: files or globs to read")
    out += data_problems(cfg, lambda path: source_of(path, sources, exact=False), v)
    out += _eval_paths_problems(cfg, v)
    out += _parallel_problems(cfg, v)
    out += _compile_problems(cfg, sources)
    if not out:  # batch arithmetic needs valid degrees
        out += _batch_problems(cfg, v)
    return out


def _batch_problems(cfg: RunConfig, v) -> list[str]:
    """global_batch = micro_batch × grad_accum × dp, each message with the values that would work."""
    t, par = cfg.train, cfg.parallel
    dp = par.dp
    pp_mb = (par.microbatches or par.degrees()["pp"]) if par.degrees()["pp"] > 1 else 1
    micro = t.micro_batch
    if micro is None:  # derived: global_batch / (grad_accum × dp)
        accum = t.grad_accum or 1
        if t.global_batch % (accum * dp):
            what = f"{v('train.grad_accum')} × data-parallel degree {dp}" if t.grad_accum else \
                f"the data-parallel degree {dp}"
            return [f"{v('train.global_batch')} is not divisible by {what}; "
                    f"{_nearest_multiples('train.global_batch', t.global_batch, accum * dp)}"]
        micro = t.global_batch // (accum * dp)
    elif t.global_batch % (micro * dp):
        fits = [m for m in range(1, t.global_batch // dp + 1) if (t.global_batch // dp) % m == 0
                and m % pp_mb == 0] if t.global_batch % dp == 0 else []
        hint = (f"train.micro_batch may be one of {', '.join(map(str, fits))} (global {t.global_batch} / dp {dp} "
                f"= {t.global_batch // dp} per rank), or leave it unset to take {t.global_batch // dp}"
                if fits else _nearest_multiples("train.global_batch", t.global_batch, micro * dp))
        return [f"{v('train.global_batch')} is not divisible by {v('train.micro_batch')} × data-parallel "
                f"degree {dp}; {hint}"]
    elif t.grad_accum is not None and t.grad_accum * micro * dp != t.global_batch:
        return [f"{v('train.grad_accum')} × {v('train.micro_batch')} × data-parallel degree {dp} "
                f"!= {v('train.global_batch')}; leave train.grad_accum unset to take "
                f"{t.global_batch // (micro * dp)}"]
    if micro % pp_mb:
        said = (v("train.micro_batch") if t.micro_batch is not None
                else f"train.micro_batch = {micro} (train.global_batch / (train.grad_accum × data-parallel degree))")
        schedule = v("parallel.microbatches") if par.microbatches else f"parallel.microbatches = {pp_mb} (parallel.pp's)"
        pp = par.degrees()["pp"]  # (counts the schedule refuses are not offered: a review's)
        splits = [n for n in range(1, micro + 1) if micro % n == 0 and microbatch_count_fits(par.pp_schedule, n, pp)]
        micros = [m * pp_mb for m in range(1, 5)]
        counts = f"parallel.microbatches may be {', '.join(map(str, splits))}, or " if splits else ""
        return [f"{said} is not divisible by {schedule}: each micro-batch the schedule runs is a whole share of "
                f"it; {counts}train.micro_batch {', '.join(map(str, micros))} (with train.global_batch to match)"]
    return []


def _eval_paths_problems(cfg: RunConfig, v) -> list[str]:
    """eval.paths: files read as data.paths is, so a source that reads files, and files that are there."""
    paths = cfg.eval.paths
    if not paths:
        return []
    if cfg.data.source in ("builtin", "synthetic") or cfg.data.mix:
        return [f"{v('eval.paths')} is read as data.paths is, and {v('data.source')}"
                + (" with data.mix" if cfg.data.mix else "") + f" reads no files of one kind: {PATH_SOURCES_HINT}"]
    missing = [p for p in paths if not path_matches(p)]  # (as data.paths are found: ** across folders)
    return [f"{v('eval.paths')}: nothing at {', '.join(repr(p) for p in missing)}"] if missing else []


def _nearest_multiples(key: str, value: int, step: int) -> str:
    below, above = value // step * step, (value // step + 1) * step
    return f"nearest {key} that works: " + (f"{below} or {above}" if below else f"{above}")


def _parallel_problems(cfg: RunConfig, v) -> list[str]:
    par, m = cfg.parallel, cfg.model
    inferred = [d for d in PARALLEL_DEGREES if getattr(par, d) == -1]
    if 0 in [getattr(par, d) for d in PARALLEL_DEGREES]:
        return [f"parallel degrees must be positive or -1 (infer): {', '.join(v('parallel.' + d) for d in PARALLEL_DEGREES)}"]
    if len(inferred) > 1:
        return [f"at most one parallel degree may be -1 (infer), found {len(inferred)}: {', '.join(inferred)}"]
    known = 1
    for d in PARALLEL_DEGREES:
        known *= max(getattr(par, d), 1)
    world = par.world_size
    listing = " × ".join(v("parallel." + d) for d in PARALLEL_DEGREES)
    if (inferred and world % known) or (not inferred and known != world):
        return [
            f"parallel degrees {listing} do not multiply to the world size "
            f"parallel.nnodes × parallel.nproc_per_node = {world}"
        ]
    out: list[str] = []
    deg = par.degrees()
    if m.custom is None:
        if m.n_heads % deg["tp"] or m.kv_heads % deg["tp"]:
            kv = v("model.n_kv_heads") if m.n_kv_heads is not None else f"kv heads {m.kv_heads} (as many as model.n_heads)"
            fit = [d for d in range(1, world + 1) if m.n_heads % d == 0 and m.kv_heads % d == 0 and world % d == 0]
            tp = v("parallel.tp") if par.tp != -1 else f"parallel.tp = {deg['tp']} (inferred from -1)"
            out.append(f"{v('model.n_heads')} and {kv} must both be divisible by {tp}: each rank "
                       f"holds whole heads; parallel.tp may be {', '.join(map(str, fit))} "
                       f"(the degrees that divide both and the world of {world})")
        if m.arch != "moe" and m.ffn_dim % deg["tp"]:  # w1/w3 split by columns, w2 by rows: DTensor needs equal shares
            below = m.ffn_dim // deg["tp"] * deg["tp"]
            fits = " or ".join(f"model.ffn_dim={n}" for n in (below, below + deg["tp"]) if n > 0)
            out.append(f"{v('model.ffn_dim')} is not divisible by tensor-parallel degree {deg['tp']}: each rank holds "
                       f"an equal share of the feed-forward's hidden units; {fits}")
        if m.n_layers < deg["pp"]:
            out.append(f"{v('model.n_layers')} is fewer than pipeline stages {deg['pp']}")
        elif deg["pp"] > 1 and m.n_layers < deg["pp"] * par.stages_per_rank:
            out.append(f"{_stages_named(par, v)} with {v('parallel.pp')} makes "
                       f"{deg['pp'] * par.stages_per_rank} stages, more than {v('model.n_layers')}")
    if deg["pp"] > 1 and cfg.eval.every > 0:  # train/setup.py refuses it; said here before the ranks start
        out.append(f"{v('eval.every')} with {v('parallel.pp')}: evaluation under pipeline parallelism is not "
                   "supported yet (set eval.every = 0 or parallel.pp = 1)")
    if deg["pp"] > 1 and (m.custom is not None or m.tie_embeddings):
        out.append(f"{v('parallel.pp')} needs a built-in model family with untied embeddings "
                   f"({v('model.custom')}, {v('model.tie_embeddings')})")
    if deg["tp"] > 1 and m.custom is not None:
        out.append(f"{v('parallel.tp')} needs a built-in model family; {v('model.custom')}")
    if (deg["tp"] > 1 and deg["dp_replicate"] * deg["dp_shard"] == 1 and cfg.compile.backend != "eager"
            and par.fsdp_impl == "fsdp2"):
        # Seen with torch 2.13 under Inductor, aot_eager and accelrun alike: a gradient reaches DTensor's
        # Redistribute.backward as a plain tensor (AttributeError: '_local_tensor'). With FSDP over the
        # same blocks (FSDP x TP) the step runs, so only tensor parallelism alone is refused.
        out.append(f"{v('parallel.tp')} without data parallelism does not train compiled with this torch "
                   f"(a gradient reaches DTensor's redistribute as a plain tensor), and {v('compile.backend')}; "
                   "add compile.backend=eager, or data parallelism (parallel.dp_shard=2 with twice the processes)")
    if par.loss_parallel and cfg.compile.backend != "eager" and cfg.compile.scope not in ("block", "auto"):
        out.append(f"{v('parallel.loss_parallel')} compiles only with compile.scope = block "
                   f"({v('compile.scope')} would compile the sharded loss)")
    if par.fsdp_impl == "compiled":
        if cfg.compile.backend != "accelrun":
            out.append(f"{v('parallel.fsdp_impl')} needs compile.backend = accelrun (its all-gathers and "
                       f"reduce-scatters are nodes of accelrun's graphs), but {v('compile.backend')}")
        if deg["dp_replicate"] > 1:
            out.append(f"{v('parallel.fsdp_impl')} shards over parallel.dp_shard only; "
                       f"{v('parallel.dp_replicate')} needs fsdp_impl = fsdp2")
        if m.tie_embeddings:
            out.append(f"{v('parallel.fsdp_impl')} does not support {v('model.tie_embeddings')}")
    for key in ("sequence_parallel", "loss_parallel"):
        if getattr(par, key) and deg["tp"] == 1:
            out.append(f"{v('parallel.' + key)} needs tensor parallelism, but {v('parallel.tp')}")
    if par.sequence_parallel and deg["tp"] > 1 and cfg.train.seq_len % deg["tp"]:
        out.append(f"{v('train.seq_len')} is not divisible by tensor-parallel degree {deg['tp']} "
                   "(parallel.sequence_parallel shards the sequence)")
    out += _context_parallel_problems(cfg, deg, v)
    out += _document_packing_problems(cfg, deg, v)
    out += moe_problems(cfg, deg, v)
    out += _stages_per_rank_problems(par, deg, v)
    out += _microbatch_count_problems(par, deg, v, cfg.train.micro_batch)
    if par.pp_layers is not None:
        stages = deg["pp"] * par.stages_per_rank
        layers = sum(len(stage) for stage in par.pp_layers)
        if len(par.pp_layers) != stages:
            out.append(f"{v('parallel.pp_layers')} lists {len(par.pp_layers)} stages; {v('parallel.pp')} "
                       f"with {_stages_named(par, v)} makes {stages}")
        if m.custom is None and layers != m.n_layers:
            out.append(f"{v('parallel.pp_layers')} lists {layers} layers, not {v('model.n_layers')}")
    return out


def _stages_named(par, v) -> str:
    """The keys that decide how many stages a pipeline rank runs, as set."""
    if par.pp_stages_per_rank is None:
        return v("parallel.pp_schedule")
    return f"{v('parallel.pp_schedule')}, {v('parallel.pp_stages_per_rank')}"


def _stages_per_rank_problems(par, deg: dict[str, int], v) -> list[str]:
    """parallel.pp_stages_per_rank: several stages per rank only where a schedule loops them (the
    interleaved ones), and at least the two that make a loop."""
    n = par.pp_stages_per_rank
    if n is None:
        return []
    if deg["pp"] == 1:
        return [f"{v('parallel.pp_stages_per_rank')} needs pipeline parallelism, but {v('parallel.pp')}"]
    if par.pp_schedule not in INTERLEAVED_SCHEDULES and n != 1:
        return [f"{v('parallel.pp_stages_per_rank')} needs an interleaved schedule "
                f"({' or '.join(INTERLEAVED_SCHEDULES)}); {v('parallel.pp_schedule')} runs 1 stage per rank"]
    if par.pp_schedule in INTERLEAVED_SCHEDULES and n < 2:
        return [f"{v('parallel.pp_stages_per_rank')}: {v('parallel.pp_schedule')} loops at least 2 stages "
                "over each rank; nearest valid value: 2"]
    return []


def microbatch_count_fits(schedule: str, microbatches: int, pp: int) -> bool:
    """torch's own rule for each schedule (torch.distributed.pipelining.schedules): 1F1B keeps every
    stage busy, so at least one micro-batch a stage; the interleaved ones run them in rounds of pp."""
    if schedule == "1f1b":
        return microbatches >= pp
    if schedule in INTERLEAVED_SCHEDULES:
        return microbatches % max(1, microbatches // pp) == 0
    return True


def _microbatch_count_problems(par, deg: dict[str, int], v, micro_batch: int | None) -> list[str]:
    """parallel.microbatches that torch's schedule refuses when it is built, on every rank (a trial's job
    validated, launched and crashed at setup; at scale, after its 512 GPUs were given)."""
    pp, n = deg["pp"], par.microbatches
    if pp == 1 or n is None or microbatch_count_fits(par.pp_schedule, n, pp):
        return []
    fits = [m for m in range(1, 4 * max(n, pp) + 1) if microbatch_count_fits(par.pp_schedule, m, pp)
            and (micro_batch is None or micro_batch % m == 0)]  # (and split train.micro_batch: a review's)
    if not fits:
        fits = [m for m in range(1, 4 * max(n, pp) + 1) if microbatch_count_fits(par.pp_schedule, m, pp)]
    nearest = sorted(fits, key=lambda m: (abs(m - n), m))[:2]
    why = (f"needs at least one micro-batch per pipeline stage ({pp})" if par.pp_schedule == "1f1b"
           else f"runs micro-batches in rounds (their count // parallel.pp = {n} // {pp} = {max(1, n // pp)}), "
                "and their count is a multiple of the rounds")
    return [f"{v('parallel.microbatches')} with {v('parallel.pp_schedule')}: the schedule {why}; "
            f"parallel.microbatches may be {' or '.join(map(str, sorted(nearest)))}, or "
            "parallel.pp_schedule=gpipe (any count)"]


# Model families whose attention can run on sequence shards (their ModelSpec has a context_parallel
# hook, accelrun.models.families; a test keeps the two in step so that `validate` needs no torch).
CP_FAMILIES = ("llama",)


def _document_packing_problems(cfg: RunConfig, deg: dict[str, int], v) -> list[str]:
    """data.packing = document: each batch carries the tokens' positions in their documents, which the
    training step hands to the model (every pipeline stage) with the tokens. Context parallelism's ring
    attention over sequence chunks has no document mask yet."""
    if cfg.data.packing != "document":
        return []
    out: list[str] = []
    if cfg.data.source == "synthetic":
        out.append(f"{v('data.packing')} needs documents, and {v('data.source')} has none (use concat)")
    if deg["cp"] > 1:  # ring attention over sequence chunks has no document mask
        out.append(f"{v('data.packing')} with {v('parallel.cp')} is not supported yet (use concat, or parallel.cp = 1)")
    return out


def _context_parallel_problems(cfg: RunConfig, deg: dict[str, int], v) -> list[str]:
    """parallel.cp > 1: the sequence splits into 2 × cp chunks (a head and a tail per rank), and only
    what accelrun.dist.context_parallel supports."""
    par, m, cp = cfg.parallel, cfg.model, deg["cp"]
    if cp == 1:
        return []
    out: list[str] = []
    if cfg.train.seq_len % (2 * cp):
        below = cfg.train.seq_len // (2 * cp) * (2 * cp)
        fits = " or ".join(str(n) for n in (below, below + 2 * cp) if n > 0)
        out.append(f"{v('train.seq_len')} is not divisible by {2 * cp}, twice {v('parallel.cp')} (each "
                   f"context-parallel rank holds two chunks of seq_len / (2 × cp) tokens); the nearest that divide: "
                   f"train.seq_len={fits}")
    if m.custom is not None:
        out.append(f"{v('parallel.cp')} needs a model family whose attention can be sharded along the "
                   f"sequence ({', '.join(CP_FAMILIES)}); {v('model.custom')}")
    elif m.arch not in CP_FAMILIES:
        out.append(f"{v('parallel.cp')}: the attention of {v('model.arch')} cannot be sharded along the "
                   f"sequence (context parallelism supports {', '.join(CP_FAMILIES)})")
    if deg["pp"] > 1:
        out.append(f"{v('parallel.cp')} with {v('parallel.pp')} is not supported yet")
    if par.loss_parallel:
        out.append(f"{v('parallel.cp')} with {v('parallel.loss_parallel')} is not supported yet")
    if par.fsdp_impl == "compiled":
        out.append(f"{v('parallel.cp')} needs parallel.fsdp_impl = fsdp2 (FSDP over dp_shard × cp), "
                   f"but {v('parallel.fsdp_impl')}")
    if cfg.eval.every > 0:
        out.append(f"{v('parallel.cp')} with {v('eval.every')} is not supported yet (set eval.every = 0)")
    return out


def _compile_problems(cfg: RunConfig, sources: dict[KeyPath, Source]) -> list[str]:
    """Pass and executor names exist and pass options fit (only checked for the accelrun backend)."""
    c = cfg.compile
    if c.backend != "accelrun":
        return []
    # The names and option schemas are config's (compile_names, torch-free); the compiler reads them.
    out: list[str] = []
    try:
        parse_passes(c.passes)
    except PassConfigError as e:
        path = ("compile", "passes") if e.index is None or isinstance(c.passes, str) else ("compile", "passes", e.index)
        out.append(f"{'.'.join(map(str, path))} ({source_of(path, sources, exact=False)}): {e}")
    known = BUILTIN_EXECUTORS
    for i, name in enumerate(c.executors):
        if name not in known:
            close = nearest(name, list(known))
            hint = f" (did you mean {close!r}?)" if close else ""
            out.append(
                f"compile.executors.{i} ({source_of(('compile', 'executors', i), sources, exact=False)}): "
                f"unknown executor {name!r}{hint}; executors: {', '.join(known)}"
            )
    return out


# Keys read by one source only; the others warn when a user sets them (packing applies to every source).
SOURCE_SPECIFIC_DATA_KEYS = ("builtin", "tokenizer", "max_bytes", "text_field", "format", "messages_field", "loss_on")


# Keys only chat records (data.format = chat) read.
CHAT_ONLY_DATA_KEYS = ("messages_field", "loss_on")


def _is_its_default(cfg: RunConfig, path: tuple[str, ...]) -> bool:
    """A section's key a file sets to the schema's own default: moot or not, it changes nothing (a run's
    resolved config.yaml writes every default, and `validate` of it warned of five keys accelrun wrote)."""
    if len(path) < 2:
        return False
    section: Any = cfg
    for key in path[:-1]:  # (nested sections too: train.activation_checkpoint.every_n)
        section = getattr(section, key, None)
        if not isinstance(section, BaseModel):
            return False
    field = type(section).model_fields.get(path[-1])
    return field is not None and not field.is_required() and getattr(section, path[-1]) == field.get_default(
        call_default_factory=True)


def _nearest(value: int, candidates: list[int]) -> int | None:
    """The candidate nearest ``value`` (the smaller on a tie), or None."""
    return min(candidates, key=lambda c: (abs(c - value), c)) if candidates else None


def config_warnings(cfg: RunConfig, sources: dict[KeyPath, Source]) -> list[str]:
    """Values the user set that will have no effect, and settings that are legal but probably wrong.

    Only keys the user set (in their own files or an override) are reported, never schema defaults,
    nor what a shared recipe on the search path set (recipes/data/stdlib.yaml's data.builtin): the user's
    data.source=documents or compile.backend=eager made that moot, and they did not write it.
    """
    shared_dirs = [d.resolve() for d in search_path()]

    def set_by_user(*path: str) -> Source | None:
        src = sources.get(tuple(path))
        if src is None or src.kind == "default" or (src.kind == "file" and _is_its_default(cfg, path)):
            return None  # (an override the user typed warns even at the default: they meant something)
        if src.kind == "file" and src.file and any(Path(src.file).resolve().is_relative_to(d) for d in shared_dirs):
            return None
        return src

    out: list[str] = []
    if cfg.model.custom is not None:
        ignored = [k for k in ModelConfig.model_fields if k in FAMILY_ONLY_KEYS and set_by_user("model", k)]
        if ignored:
            out.append(f"model.custom is set, so these keys of the model families are not used: "
                       f"model.{', model.'.join(ignored)}")
        if cfg.model.hf is not None and (src := set_by_user("model", "hf")):
            # the factory builds the model: the folder's weights and shape are not read (found by a new user)
            read = ("only its tokenizer is read (data.tokenizer = hf)" if cfg.data.tokenizer == "hf"
                    else "it is not read at all")  # fmt: skip
            out.append(f"model.hf ({src}) is a transformers folder, and model.custom builds the model: the folder's "
                       f"weights and shape are not loaded into it; {read}")
    for key in SOURCE_SPECIFIC_DATA_KEYS if not cfg.data.mix else ():
        if key not in DATA_KEYS_USED_BY[cfg.data.source] and (src := set_by_user("data", key)):
            out.append(f"data.{key} ({src}) has no effect with data.source = {cfg.data.source}")
    if cfg.data.format == "text" and "format" in DATA_KEYS_USED_BY.get(cfg.data.source, ()):
        for key in CHAT_ONLY_DATA_KEYS:  # (a trial's data.loss_on=all on text records passed without a word)
            if src := set_by_user("data", key):
                out.append(f"data.{key} ({src}) has no effect with data.format = text (it reads chat records: "
                           "data.format=chat)")
    out += mix_warnings(cfg, set_by_user)
    if cfg.eval.paths and cfg.eval.every == 0 and (src := set_by_user("eval", "paths")):
        out.append(f"eval.paths ({src}) has no effect with eval.every = 0 (no evaluation)")
    if cfg.eval.paths and (src := set_by_user("eval", "split")):
        out.append(f"eval.split ({src}) has no effect with eval.paths set (the evaluation is on those files, "
                   "and training reads all of data.paths)")
    # Settings of a feature the recipe leaves off (a trial's microbatches, pp_schedule and every_n, with pp 1
    # and checkpointing off, validated without a word, and changed the training hash all the same).
    if cfg.parallel.degrees()["pp"] == 1:
        for key in ("microbatches", "pp_schedule", "pp_layers"):  # (pp_stages_per_rank: an error, above)
            if src := set_by_user("parallel", key):
                out.append(f"parallel.{key} ({src}) has no effect with parallel.pp = 1 (no pipeline)")
    if cfg.train.activation_checkpoint.mode != "every_n" and (src := set_by_user("train", "activation_checkpoint",
                                                                                   "every_n")):
        out.append(f"train.activation_checkpoint.every_n ({src}) has no effect with train.activation_checkpoint.mode "
                   f"= {cfg.train.activation_checkpoint.mode} (it is read by mode every_n)")
    out += tokenizer_warnings(cfg)
    out += moe_warnings(cfg, set_by_user)
    if cfg.compile.backend == "eager":
        for key in ("scope", "fullgraph", "passes", "executors", "cache_dir", "debug_numerics", "dump"):
            if src := set_by_user("compile", key):
                out.append(f"compile.{key} ({src}) has no effect with compile.backend = eager")
    elif cfg.compile.backend == "inductor":
        for key in ("passes", "executors", "cache_dir", "debug_numerics", "dump"):
            if src := set_by_user("compile", key):
                out.append(f"compile.{key} ({src}) is read by the accelrun backend only, not by inductor")
    # A warm-up longer than the run: the learning rate never reaches its peak, and never decays. Warned
    # where the user set the warm-up, the learning rate it never reaches (a new user's lr=1e-3 over 20 steps
    # peaked at 6.7e-4) or the run's length (three new users' trials ran 10-60 steps of a recipe whose
    # warm-up is 30, and read its loss as the schedule's); a shipped recipe's own pair is its choice.
    warmup = cfg.train.lr_schedule.warmup_steps
    lr_set = set_by_user("train", "optimizer", "lr")
    # As long as the run (a trial's 30 of 30) it reaches the rate at the last step only.
    if warmup >= cfg.train.steps and (set_by_user("train", "lr_schedule", "warmup_steps") or lr_set
                                      or set_by_user("train", "steps")):
        reached = cfg.train.optimizer.lr * cfg.train.steps / warmup
        lr = f"train.optimizer.lr = {cfg.train.optimizer.lr:g}"
        said = (f"exceeds train.steps = {cfg.train.steps}: the learning rate never reaches {lr}, only "
                f"{reached:.2g} at the last step," if warmup > cfg.train.steps else
                f"equals train.steps = {cfg.train.steps}: the learning rate reaches {lr} at the last step only")
        out.append(
            f"train.lr_schedule.warmup_steps = {warmup} ({source_of(('train', 'lr_schedule', 'warmup_steps'), sources)}) "
            f"{said} and never decays; train.lr_schedule.warmup_steps={max(cfg.train.steps // 10, 1)} (a tenth of "
            "the steps) reaches it"
        )
    report_warmup = cfg.report.warmup_steps
    if report_warmup >= cfg.train.steps > 1 and (set_by_user("report", "warmup_steps") or set_by_user("train", "steps")):
        # (a trial's report.warmup_steps=400 over 300 steps passed validate; the run's figures were all n/a)
        out.append(f"report.warmup_steps = {report_warmup} ({source_of(('report', 'warmup_steps'), sources)}) is not "
                   f"below train.steps = {cfg.train.steps}: no step is left for the report's steady-state figures "
                   f"(step time, tokens/s, MFU: n/a); report.warmup_steps={min(3, max(cfg.train.steps - 1, 0))} "
                   "leaves them some")
    if (profiled := cfg.report.profile_steps) is not None and profiled[0] > cfg.train.steps:
        out.append(f"report.profile_steps = [{profiled[0]}, {profiled[1]}] starts after train.steps = "
                   f"{cfg.train.steps}: nothing will be profiled")
    return out

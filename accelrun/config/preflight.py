"""What ``train`` checks before the first tensor exists, as one table that ``validate`` runs too.

Each check reads the resolved recipe and the machine's facts (no torch): files named by the recipe
exist and can be read, and the processes fit the node. ``train`` passes the machine as torch sees it;
``validate`` counts it without importing torch. A finding is fatal (exit 2, before a run directory
exists) or a warning (the run would go on, but measure something else).

Example::

    for warning in preflight(resolved.config, resolved.sources, Machine.here()):
        print("warning:", warning)          # fatal findings raise ConfigError (exit 2)
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelrun.config.compose import Source
from accelrun.config.data_checks import record_files_as_text, record_files_named
from accelrun.config.errors import ConfigError
from accelrun.config.record_paths import EXTENSIONS as RECORD_EXTENSIONS
from accelrun.config.record_paths import empty_corpus, other_separator, path_names
from accelrun.config.schema import RunConfig
from accelrun.config.validate import source_of
from accelrun.config.yaml_lines import KeyPath
from accelrun.errors import UserError
from accelrun.models.forward_errors import said, sizes_disagree, users_line

# Where a Linux NVIDIA driver lists its GPUs, one folder each (read without importing torch).
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class Machine:
    """This node as the checks need it."""

    cores: int
    cuda_devices: int  # visible to this process
    # Whether ATen has bf16 matrix-product kernels for this CPU (torch_private.cpu_has_half_gemm); None:
    # not asked (validate answers without torch, and only torch knows what its kernels take).
    cpu_bf16_gemm: bool | None = None

    @classmethod
    def here(cls) -> Machine:
        """Counted without torch: the driver's GPU folders, narrowed by CUDA_VISIBLE_DEVICES."""
        gpus = len(list(NVIDIA_GPUS.iterdir())) if NVIDIA_GPUS.is_dir() else 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus = min(gpus, len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"]))
        return cls(cores=os.cpu_count() or 1, cuda_devices=gpus)


@dataclass(frozen=True)
class Finding:
    message: str
    fatal: bool  # exit 2 before anything runs; else a warning


Check = Callable[[RunConfig, dict[KeyPath, Source], Machine], list[Finding]]


def uses_cuda(cfg: RunConfig, machine: Machine) -> bool:
    """Ranks train on GPUs when there are any and train.device allows them (dist.worker.rank_uses_cuda)."""
    return machine.cuda_devices > 0 and cfg.train.device in ("auto", "cuda")


def rank_threads(cores: int, nproc_per_node: int) -> int:
    """Threads of each CPU rank: ranks on one node share its cores (left alone, each would start one
    thread per core)."""
    return max(1, cores // nproc_per_node)


def data_files(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[Finding]:
    """Every data.paths pattern of a text or tokens source matches a file; a documents source's name
    record files whose records have the field the recipe reads."""
    if cfg.data.mix:
        return mix_record_findings(cfg, sources)
    if cfg.data.source == "documents" and cfg.data.paths:
        return record_findings(cfg, sources)
    if cfg.data.source not in ("text", "tokens") or not cfg.data.paths:
        return []
    from accelrun.config.data_paths import expand_paths

    try:
        files = expand_paths(cfg.data.paths)
    except UserError as e:
        return [Finding(f"{m} ({source_of(('data', 'paths'), sources, exact=False)})", True) for m in e.messages]
    if cfg.data.source == "text" and (records := _record_files_matched(cfg.data.paths, files)):
        return [Finding(record_files_as_text(records, f"data.source = text ({source_of(('data', 'source'), sources)})",
                                             "data"), True)]
    if cfg.data.source == "text" and all(_size(f) == 0 for f in files):  # validate passed it; train refused it
        return [Finding(f"{empty_corpus(files)} ({source_of(('data', 'paths'), sources)})", True)]
    if cfg.data.source == "text" and (empty := [f for f in files if _size(f) == 0]):  # a glob's empty match
        return [_adding_nothing("data.paths", path_names(empty), len(empty), ("is empty", "are empty"),
                                source_of(("data", "paths"), sources))]
    if cfg.data.source == "tokens" and cfg.data.packing == "document":
        # Document packing reads each token file's document index (data/doc_index.py: NAME.docs beside NAME.tok).
        unindexed = [f for f in files if Path(f).suffix == ".tok" and not Path(f).with_suffix(".docs").is_file()]
        if unindexed:
            where = source_of(("data", "packing"), sources)
            return [Finding(f"{unindexed[0]}: no document index ({Path(unindexed[0]).with_suffix('.docs').name}) "
                            f"beside it, and data.packing = document ({where}) reads one; prepare it again with "
                            "accelrun data prepare, or use data.packing: concat", True)]
    return []


def _adding_nothing(key: str, names: str, count: int, state: tuple[str, str], where: Source) -> Finding:
    """The warning for files a glob matched beside others that add nothing (``state``: singular, plural):
    they had been skipped without a word."""
    said = f"{state[0]} and adds" if count == 1 else f"{state[1]} and add"
    return Finding(f"{key}: {names} {said} nothing ({where})", False)


def _size(f: Path) -> int | None:
    """The file's size; None where it cannot be read (train's reader says why, not "empty")."""
    try:
        return f.stat().st_size
    except OSError:
        return None


def _record_files_matched(patterns: list[str], files: list[Path]) -> list[str]:
    """Record files a glob or folder of ``patterns`` matched: a text source would read their JSON or
    binary layout as text. Those a pattern names itself are validate's to report (``data_problems``)."""
    if record_files_named(patterns):
        return []
    return [str(f) for f in files if f.suffix.lower() in RECORD_EXTENSIONS]


@dataclass(frozen=True)
class CappedText:
    """A text source's files against ``data.max_bytes``: what is read of how much."""

    cap: int
    total: int
    files: int
    files_whole: int  # read to their end; the next is cut short, the rest are not read
    paths_key: str = "data.paths"  # or a mix entry's, "data.mix.1.paths"

    def said(self, where: Source) -> str:
        left = self.files - self.files_whole
        return (f"data.max_bytes = {self.cap:,} ({where}) reads {self.cap:,} of the {self.total:,} bytes that "
                f"{self.paths_key} names: {left} of its {self.files} file(s) read in part or not at all; "
                "data.max_bytes=null reads them all")


def capped_texts(cfg: RunConfig) -> list[CappedText]:
    """What ``data.max_bytes`` leaves unread of each text source's files (it stops reading there): the
    source's, or each of data.mix's text entries' (each read alone, with the recipe's data.max_bytes: a
    mix's cut said so nowhere, a trial's). A new user's corpus cut at the 64 MiB default said so nowhere."""
    data = cfg.data
    if data.max_bytes is None:
        return []
    if data.mix:
        read = [(f"data.mix.{i}.paths", list(e.paths)) for i, e in enumerate(data.mix) if e.source == "text"]
    else:
        read = [("data.paths", list(data.paths))] if data.source == "text" else []
    return [cut for key, paths in read if paths and (cut := _capped(paths, data.max_bytes, key)) is not None]


def _capped(paths: list[str], cap: int, key: str) -> CappedText | None:
    from accelrun.config.data_paths import expand_paths

    try:
        sizes = [os.stat(f).st_size for f in expand_paths(paths)]
    except (UserError, OSError):
        return None  # data_files says what is wrong with the paths
    total = sum(sizes)
    if total <= cap:
        return None
    whole = next(i for i, read in enumerate(itertools.accumulate(sizes)) if read > cap)
    return CappedText(cap, total, len(sizes), whole, key)


def text_cut_by_max_bytes(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[Finding]:
    """A warning where ``data.max_bytes`` leaves part of a text corpus unread."""
    where = source_of(("data", "max_bytes"), sources)
    return [Finding(cut.said(where), False) for cut in capped_texts(cfg)]


def record_findings(cfg: RunConfig, sources: dict[KeyPath, Source]) -> list[Finding]:
    """data.paths names record files; the first record (header, schema) of each has the field data.format
    reads, and under data.format = text holds text there; a malformed first JSON line and a corpus whose
    every file is empty are named: caught here, before a model is built, rather than minutes into a run.
    Records past the first are checked when training reads them (validate says so)."""
    data = cfg.data
    field_path, field = (("data", "text_field"), data.text_field) if data.format == "text" else \
        (("data", "messages_field"), data.messages_field)
    return _first_records(data.paths, ("data", "paths"), field_path, field, data.format, sources)


def mix_record_findings(cfg: RunConfig, sources: dict[KeyPath, Source]) -> list[Finding]:
    """``record_findings`` for each ``data.mix`` source that reads record files, naming its own keys."""
    from accelrun.config.data_paths import expand_paths

    findings: list[Finding] = []
    for i, entry in enumerate(cfg.data.mix):
        if entry.source == "documents" and entry.paths:
            findings += _first_records(entry.paths, ("data", "mix", i, "paths"), ("data", "mix", i, "text_field"),
                                       entry.text_field, "text", sources)
        elif entry.source in ("text", "tokens") and entry.paths:  # (validate passed a glob matching nothing:
            try:                                                    # train refused it after making its folder)
                expand_paths(entry.paths, key=f"data.mix.{i}.paths")
            except UserError as e:
                where = source_of(("data", "mix", i, "paths"), sources, exact=False)
                findings += [Finding(f"{m} ({where})", True) for m in e.messages]
    return findings


def _first_records(paths: list[str], paths_key: KeyPath, field_path: KeyPath, field: str, fmt: str,
                   sources: dict[KeyPath, Source]) -> list[Finding]:
    from accelrun.config.record_paths import file_names, peek_records, record_files, skipped_note

    skipped: list[Path] = []
    try:
        files = record_files(paths, key=".".join(map(str, paths_key)), skipped=skipped)
        peeks = [peek_records(f) for f in files]
    except UserError as e:
        return [Finding(f"{m} ({source_of(paths_key, sources, exact=False)})", True) for m in e.messages]
    field_key = ".".join(map(str, field_path))
    where = source_of(field_path, sources)
    now = f"now {field!r}, {where}"
    for f, peek in zip(files, peeks, strict=True):
        if peek.fields and field not in peek.fields:
            shown = ", ".join(repr(x) for x in peek.fields)
            chat = fmt == "text" and "messages" in peek.fields  # chat records read as plain documents
            fix = ("these are chat records: data.format=chat reads them" if chat
                   else f"set {field_key} ({now}) to one of them{other_separator(peek.fields)}")
            return [Finding(f"{f.path}: no field {field!r} (fields: {shown}); {fix}", True)]
        value = None if peek.first is None else peek.first.get(field)
        if fmt == "text" and peek.first is not None and not isinstance(value, str):
            shown = "null" if value is None else f"{type(value).__name__} {repr(value)[:40]}"
            return [Finding(f"{peek.where}: {field_key} {field!r} is {shown}, not text; set {field_key} ({where}) to "
                            "the field holding each document's text", True)]
    if all(p.empty for p in peeks):
        return [Finding(f"{'.'.join(map(str, paths_key))}: the corpus is empty: no records in {file_names(files)} "
                        f"({source_of(paths_key, sources, exact=False)})", True)]
    out = []
    if empty := [f for f, peek in zip(files, peeks, strict=True) if peek.empty]:  # a glob's empty match
        out.append(_adding_nothing(".".join(map(str, paths_key)), file_names(empty), len(empty),
                                   ("holds no records", "hold no records"), source_of(paths_key, sources, exact=False)))
    if note := skipped_note(skipped):
        out.append(Finding(f"{'.'.join(map(str, paths_key))}: {note}", False))
    return out


def custom_model_problems(cfg: RunConfig, sources: dict[KeyPath, Source], unchecked: list[str] | None = None) -> list[str]:
    """model.custom's module imports and names a callable that takes model.kwargs; the model it builds
    on the meta device (no memory, no initialisation: seconds for a large one) has a token table the
    data's ids fit in, and a forward that takes ``positions_BT`` under document packing. ``validate``
    only: it imports the user's code, which ``train``'s launcher must not (a module may read RANK or
    touch a GPU when imported); ``train``'s ranks report the same problems, exit 2, when they build
    the model. What could not be checked there (a factory or forward that cannot run on the meta
    device) goes to ``unchecked``, in words: validate said "valid" of a factory that raised (a new user).
    """
    if cfg.model.custom is None:
        return []
    from accelrun.models.build import check_custom_kwargs

    try:
        check_custom_kwargs(cfg.model.custom, dict(cfg.model.kwargs))
    except UserError as e:
        return [f"{m}{custom_model_key(e, sources)}" for m in e.messages]
    return _built_custom_model_problems(cfg, sources, unchecked if unchecked is not None else [])


def custom_model_key(e: UserError, sources: dict[KeyPath, Source]) -> str:
    """`` (key: where it was set)`` for an error building a user's model: the model.kwargs entry at fault
    (its own line, not the line of ``kwargs:`` above it), model.kwargs, or model.custom. Named with where
    it was set: "(default)" alone read as part of the message (a new user's trial)."""
    from accelrun.models.build import ModelKwargsError

    key: KeyPath = ("model", "custom")
    if isinstance(e, ModelKwargsError):
        key = ("model", "kwargs", e.name) if e.name else ("model", "kwargs")
    return f" ({'.'.join(key)}: {source_of(key, sources, exact=False)})"


def _built_custom_model_problems(cfg: RunConfig, sources: dict[KeyPath, Source], unchecked: list[str]) -> list[str]:
    """What ``train`` finds once it has built a user's model, found on the meta device instead. A
    factory that cannot build there (it loads weights, computes at init) is left to ``train``."""
    from accelrun.data.build import check_vocab
    from accelrun.models.build import (
        ModelBuildError,
        build_model,
        data_vocab,
        document_packing_problem,
        position_table_problem,
    )

    where = str(source_of(("model", "custom"), sources))
    if cfg.model.kwargs:  # what the model's sizes come from too: `model.kwargs={vocab_size: 200}` made the table
        where += f"; model.kwargs: {source_of(('model', 'kwargs'), sources, exact=False)}"
    try:
        model = build_model(cfg.model, "meta")
    except ModelBuildError as e:  # accelrun's own findings (not a module; a forward it cannot call): train's too
        # and the factory's own errors, but for those of the meta device (a factory that loads weights
        # or computes at init), which train, building on its device, does not meet
        if e.__cause__ is None or not _meta_device_error(e.__cause__):
            return [f"{m} (model.custom: {where})" for m in e.messages]
        unchecked.append(_not_built(cfg, e.__cause__))
        return []
    except Exception as e:  # noqa: BLE001 (only a head start: train builds it on its device and says why)
        unchecked.append(_not_built(cfg, e))
        return []
    out = []
    if cfg.train.activation_checkpoint.mode != "none":  # train refused it after validate said "valid" (a trial's)
        from accelrun.compile.compile_model import checkpointed_blocks, no_blocks_to_checkpoint
        from accelrun.models.build import transformer_blocks

        if checkpointed_blocks(model, transformer_blocks(model)) is None:
            out.append(f"{no_blocks_to_checkpoint(model)} (train.activation_checkpoint.mode: "
                       f"{source_of(('train', 'activation_checkpoint', 'mode'), sources)})")
    if cfg.data.packing == "document" and (problem := document_packing_problem(model)) is not None:
        out.append(f"{problem} (model.custom: {where})")
    if (problem := position_table_problem(model, cfg.train.seq_len)) is not None:
        out.append(f"{problem} (train.seq_len: {source_of(('train', 'seq_len'), sources)})")
    rows, custom = data_vocab(cfg.model, model)
    if custom is not None and (ids := data_token_ids(cfg)) is not None:
        try:
            check_vocab(ids, rows, f"data.tokenizer {cfg.data.tokenizer!r}", custom)
        except UserError as e:
            out += [f"{m} (model.custom: {where})" for m in e.messages]
    if not out and (ids := ids_the_logits_cover(cfg, rows)) is not None:
        shape = (cfg.train.micro_batch, cfg.train.seq_len)
        out += [f"{m} (model.custom: {where})" for m in _logits_problems(model, shape, ids, unchecked)]
    return out


def _meta_device_error(e: BaseException) -> bool:
    """Whether a factory failed for want of data on the meta device ("Cannot copy out of meta tensor",
    "Tensor.item() cannot be called on meta tensors", an op with no meta kernel), not for its inputs
    (model.kwargs naming no option: KeyError 'swiglue', which validate had called valid)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:  # (`raise e from e` makes a chain a loop)
        if _META_WORD.search(str(e)):  # torch's words: "meta tensors", "meta device", "Meta kernel", "register_meta"
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


_META_WORD = re.compile(r"(\b|_)meta\b", re.IGNORECASE)  # not "metadata"


def _not_built(cfg: RunConfig, e: BaseException) -> str:
    return (f"model.custom = {cfg.model.custom!r} could not be built on the meta device ({said(e)}): its token "
            "table, position table and logits are left to train")


def _logits_problems(model: Any, shape: tuple[int, int], vocab_size: int, unchecked: list[str]) -> list[str]:
    """What the first training step would refuse in the forward's output (logits of the wrong shape, or
    the hidden states where the head was left out: ``models.build.logits_of``), found by running the
    user's forward and loss on meta tensors (without autograd). A forward that cannot run there
    (data-dependent sizes, a host read) is left to ``train``."""
    import torch

    from accelrun.models.build import ModelOutputError, training_loss_fn

    tokens = torch.zeros(shape, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            training_loss_fn(model, vocab_size)(tokens, tokens)
    except ModelOutputError as e:
        return list(e.messages)
    except Exception as e:  # noqa: BLE001 (only a head start, as above)
        if sizes_disagree(e) and not _meta_device_error(e):
            # The model's own sizes do not fit (model.kwargs={dim: 60, heads: 7}: a view to 7 heads of 8):
            # the first step fails the same way. A trial's validate said "valid" and train crashed.
            return [f"{type(model).__name__}.forward fails on a batch of {shape[0]} x {shape[1]} tokens: "
                    f"{said(e)}{users_line(e)}"]
        unchecked.append(f"{type(model).__name__}.forward could not run on the meta device ({said(e)}): "
                         "the shape of its logits is left to train")
    return []


def ids_the_logits_cover(cfg: RunConfig, drawn: int) -> int | None:
    """How many token ids a user's logits need a class for (``models.build.logits_of``): the tokenizer's,
    or for synthetic data the ``drawn`` it draws from (``data_vocab``'s); None where that is not known
    before reading the data (token files, mixtures), and nothing is checked. Not ``model.vocab_size``
    itself: a model whose token table cannot be told takes that number, 512 in model/debug, while the
    byte tokenizer makes 258 ids."""
    return drawn if cfg.data.source == "synthetic" and not cfg.data.mix else data_token_ids(cfg)


def data_token_ids(cfg: RunConfig) -> int | None:
    """How many token ids the data's tokenizer makes (the largest + 1), where validate can tell without
    reading the data: the byte tokenizer's, or a tokenizer.json's; None otherwise."""
    from accelrun.config.tokenizer_file import (
        BYTE,
        BYTE_VOCAB,
        TokenizerFileError,
        read_tokenizer_info,
        resolve_model_hf,
    )

    data = cfg.data
    if data.source in ("synthetic", "tokens") or data.mix:
        return None
    if data.tokenizer == BYTE:
        return BYTE_VOCAB
    try:
        return read_tokenizer_info(resolve_model_hf(data.tokenizer, cfg.model.hf, "data.tokenizer")).vocab_size
    except TokenizerFileError:  # reported by the tokenizer's own check
        return None


def hf_weights(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[Finding]:
    """model.hf has weights whose headers read (config.json was read by validation already)."""
    if cfg.model.hf is None:
        return []
    from accelrun.config.hf_weights import weight_files

    try:
        weight_files(Path(cfg.model.hf))
    except UserError as e:
        return [Finding(f"{m} (model.hf: {source_of(('model', 'hf'), sources)})", True) for m in e.messages]
    return []


def processes_fit(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[Finding]:
    """One GPU per CUDA process (fatal); CPU ranks × threads within the cores (a warning: they would
    time-slice, and every step time, so tokens/s and MFU, would measure the contention)."""
    par, threads = cfg.parallel, cfg.train.threads
    if uses_cuda(cfg, machine):
        if par.nproc_per_node <= machine.cuda_devices:
            return []
        where = source_of(("parallel", "nproc_per_node"), sources)
        return [Finding(f"parallel.nproc_per_node = {par.nproc_per_node}, but this node has {machine.cuda_devices} "
                        f"CUDA device(s) (one process per GPU; set parallel.nproc_per_node <= "
                        f"{machine.cuda_devices}, or train.device = cpu); parallel.nproc_per_node: {where}", True)]
    if threads is None and par.nproc_per_node == 1:
        return []  # one process with torch's own thread count
    per_rank = threads or rank_threads(machine.cores, par.nproc_per_node)
    if par.nproc_per_node * per_rank <= machine.cores:
        return []
    chosen = f"train.threads = {threads}" if threads else "train.threads auto"
    return [Finding(f"{par.nproc_per_node} process(es) × {per_rank} thread(s) ({chosen}) on "
                    f"{machine.cores} cores: they will share cores, so step times measure the contention; "
                    "lower train.threads or parallel.nproc_per_node", False)]


def gpu_only_keys(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[Finding]:
    """train.float8 and parallel.async_tp on a run without CUDA, or async TP without tp > 1 and Inductor (fatal)."""
    from accelrun.config.gpu_only import gpu_only_problems

    return [Finding(m, True) for m in gpu_only_problems(cfg, sources, uses_cuda(cfg, machine))]


def cpu_bf16_without_kernels(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[Finding]:
    """bf16-mixed on a CPU without bf16 matrix kernels, where nothing runs its products another way: ATen's
    generic bf16 loop there is tens of times slower than fp32 (a warning)."""
    if cfg.train.precision != "bf16-mixed" or uses_cuda(cfg, machine) or machine.cpu_bf16_gemm is not False:
        return []
    from accelrun.config.compile_names import pass_names

    where = source_of(("train", "precision"), sources)
    if cfg.compile.backend == "accelrun" and "cpu_half_gemm" in pass_names(cfg.compile.passes):
        if cfg.compile.scope != "block":
            return []
        # Only the blocks go through the compiler: the output head's product (the widest, vocab x dim)
        # and anything else between them run eagerly, in that loop.
        scope = source_of(("compile", "scope"), sources)
        return [Finding(f"{scope}: compile.scope = block with train.precision = bf16-mixed ({where}) on a CPU "
                        "without bf16 matrix kernels: accelrun runs the blocks' bf16 matmuls as fp32 GEMMs, but the "
                        "output head's and any other outside the blocks run eagerly, in ATen's generic bf16 loop "
                        "(30-70x slower than fp32 here); compile.scope=loss (auto's choice for a model family) or model "
                        "compiles the head too", False)]  # fmt: skip
    return [Finding(f"{where}: train.precision = bf16-mixed on a CPU without bf16 matrix kernels (ATen has "
                    f"none on x86 without AVX-512 or AVX-NE-CONVERT): with compile.backend = "
                    f"{cfg.compile.backend}, each bf16 matmul runs in ATen's generic loop, 30-70x slower than "
                    "in fp32 here; compile.backend=accelrun runs them as fp32 GEMMs (its cpu_half_gemm pass), "
                    "or set train.precision=fp32", False)]  # fmt: skip


def cuda_asked_for(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[Finding]:
    """train.device = cuda on a node without a CUDA device (fatal, as more processes than GPUs are)."""
    if cfg.train.device != "cuda" or machine.cuda_devices > 0:
        return []
    return [Finding(f"train.device = cuda ({source_of(('train', 'device'), sources)}), but this node has no CUDA "
                    "device (train.device=auto trains on whatever the node has; to check a GPU recipe from here, "
                    "`accelrun train RECIPE --dry-run` builds its ranks' layout and `accelrun plan RECIPE` predicts "
                    "its memory and speed)", True)]


def resume_path(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[Finding]:
    """checkpoint.resume naming a path names one that exists (what it holds, train checks when it starts:
    train.resume)."""
    resume = cfg.checkpoint.resume
    if resume in ("auto", "none") or Path(resume).expanduser().exists():
        return []
    where = source_of(("checkpoint", "resume"), sources)
    return [Finding(f"checkpoint.resume = {resume} ({where}): no such checkpoint, run or checkpoints folder; "
                    '"auto" continues an interrupted run of this recipe, "none" starts afresh', True)]


# The checks `train` makes before a run directory or a tensor exists, in order; `validate` runs them all.
PREFLIGHT_CHECKS: tuple[Check, ...] = (data_files, text_cut_by_max_bytes, hf_weights, processes_fit, gpu_only_keys, cpu_bf16_without_kernels,
                                       cuda_asked_for, resume_path)


def preflight(cfg: RunConfig, sources: dict[KeyPath, Source], machine: Machine) -> list[str]:
    """Run every check: raise ConfigError with all fatal findings, else return the warnings."""
    findings = [f for check in PREFLIGHT_CHECKS for f in check(cfg, sources, machine)]
    fatal = [f.message for f in findings if f.fatal]
    if fatal:
        raise ConfigError(fatal)
    return [f.message for f in findings if not f.fatal]

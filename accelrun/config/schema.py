"""The recipe schema: one pydantic model per section, every one with ``extra="forbid"``.

Field-level checks (types, ranges) live on the fields; checks that involve several fields live
in ``validate_consistency`` so that each error can name every key it involves.
Nothing here imports torch: the schema is read by ``accelrun validate`` and by planners that
must stay light.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from accelrun.config.errors import nearest


def _one_as_list(v: Any) -> Any:
    """A lone string where a list of them is meant (``data.paths=/x/corpus.txt`` on the command line,
    ``trackers: wandb`` in a file) is that one-item list: there is nothing else it could mean."""
    return [v] if isinstance(v, str) else v


# A list of strings that also takes one string for a one-item list.
StrList = Annotated[list[str], BeforeValidator(_one_as_list)]


def _not_a_number(annotation: Any, value: Any) -> str | None:
    """Why ``value`` (or an item of it, in a list or tuple) is no number where ``annotation`` wants an int
    or a float, though pydantic's lax mode would read it as one: a boolean (true is 1), or a string that
    reads as a number (a quoted YAML number: a team's typo, or a value meant elsewhere). None otherwise."""
    if isinstance(value, list | tuple):
        items = [a for t in _leaf_types(annotation) if get_origin(t) in (list, tuple)
                 for a in get_args(t) if a is not Ellipsis]
        return next((why for a in items for v in value if (why := _not_a_number(a, v)) is not None), None)
    options = _leaf_types(annotation)
    if not options & {int, float}:
        return None
    if isinstance(value, bool):
        return None if bool in options else "expected a number, got a boolean (true/false)"
    literal_strings = {a for t in options if get_origin(t) is Literal for a in get_args(t) if isinstance(a, str)}
    if isinstance(value, str) and _reads_as_number(value) and str not in options and value not in literal_strings:
        return f"expected a number, got the string {value!r} (write it without quotes: {value.strip()})"
    return None


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _leaf_types(annotation: Any) -> set[Any]:
    """The types a value may take under ``annotation``: unions and Annotated unwrapped (lists not entered)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _leaf_types(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_leaf_types(a) for a in get_args(annotation)))
    return {annotation}


class Section(BaseModel):
    # allow_inf_nan=False: `.inf` or `.nan` for a learning rate or a size validates as nonsense.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 and "256" as 256; in a recipe either is a mistake (model.dim=true).
        if info.field_name is not None and (why := _not_a_number(cls.model_fields[info.field_name].annotation,
                                                                  value)) is not None:
            raise ValueError(why)
        return value


RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # a directory name: no separators, no leading dot
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
# A parallel degree: a positive integer, or -1 meaning "whatever the world size leaves".
Degree = Annotated[int, Field(ge=-1)]


class RopeScalingConfig(Section):
    """Llama 3.1's rotary frequency scaling (``rope_type: llama3`` in a Hugging Face config)."""

    type: Literal["llama3"] = "llama3"
    factor: Annotated[float, Field(gt=0)] = 8.0
    low_freq_factor: Annotated[float, Field(gt=0)] = 1.0
    high_freq_factor: Annotated[float, Field(gt=0)] = 4.0
    original_max_seq_len: PositiveInt = 8192


# What a user's own model (model.custom) reads of model.*: its factory and arguments, the folder a
# tokenizer may come from (data.tokenizer = hf), and vocab_size, which checks the data's token ids where
# the model's token table cannot be told. Every other model key is read by the model families only.
CUSTOM_MODEL_READS = ("custom", "kwargs", "hf", "vocab_size")


class ModelConfig(Section):
    """A decoder of one of accelrun's model families (``arch``), or a user's own model by import path."""

    arch: str = Field("llama", description="the model family: a name registered in accelrun.models.families.FAMILIES "
                      "(llama, gemma, moe, or one added there)")
    dim: PositiveInt = 256
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 8
    n_kv_heads: PositiveInt | None = Field(None, description="None = n_heads (no grouping)")
    head_dim: PositiveInt | None = Field(None, description="gemma: width of each attention head; None = dim / n_heads")
    ffn_dim: PositiveInt = 768
    vocab_size: PositiveInt = 512
    norm_eps: Annotated[float, Field(gt=0)] = 1e-5
    rope_theta: Annotated[float, Field(gt=0)] = 10000.0
    max_seq_len: PositiveInt = 2048
    tie_embeddings: bool = False
    init_std: Annotated[float, Field(gt=0)] = 0.02
    qkv_bias: bool = Field(False, description="biases on the q, k, v projections (Qwen2)")
    rope_scaling: RopeScalingConfig | None = Field(None, description="Llama 3.1's long-context scaling; None = none")
    # arch = moe (accelrun.models.families.moe): each block's feed-forward is a top-k router over experts.
    n_experts: PositiveInt = Field(8, description="moe: routed experts per block")
    experts_per_token: PositiveInt = Field(2, description="moe: experts each token is routed to (top-k)")
    moe_ffn_dim: PositiveInt = Field(256, description="moe: hidden width of each routed expert")
    shared_expert_ffn_dim: NonNegativeInt = Field(0, description="moe: hidden width of the shared expert; 0 = none")
    aux_loss_coef: Annotated[float, Field(ge=0)] = Field(0.01, description="moe: weight of the load-balancing loss")
    capacity_factor: Annotated[float, Field(gt=0)] | None = Field(
        None, description="moe: an expert takes at most capacity_factor × T × k / n_experts assignments per "
        "sequence, the rest are dropped; None = no dropping")
    hf: str | None = Field(
        None, description="a local Hugging Face model folder (config.json + *.safetensors): its config sets the "
        "model's shape keys and its weights replace the initial ones"
    )
    custom: str | None = Field(
        None, description='"package.module:factory" building an nn.Module; replaces the llama model'
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for `custom`")

    @model_validator(mode="before")
    @classmethod
    def _shape_from_hf_folder(cls, data: Any) -> Any:
        # The folder's config.json is the model: its shape replaces the recipe's (a base recipe's dim
        # must not silently win over the checkpoint's).
        # A misspelt key is reported first (an unreadable folder would hide the typo behind it).
        if isinstance(data, dict) and data.get("hf") is not None and set(data) <= set(cls.model_fields):
            from accelrun.config.hf_model import model_keys_from_hf_folder

            return {**data, **model_keys_from_hf_folder(str(data["hf"]))}
        return data

    @field_validator("arch")
    @classmethod
    def _a_registered_family(cls, v: str) -> str:
        # The registry, not a list written here: a new family is its folder and one line there.
        from accelrun.models.families import FAMILIES

        if v not in FAMILIES:
            hint = nearest(v, FAMILIES)
            raise ValueError(f"no model family {v!r}; known: {', '.join(FAMILIES)}"
                             + (f"; did you mean '{hint}'?" if hint else ""))
        return v

    @field_validator("custom")
    @classmethod
    def _custom_is_import_path(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            from accelrun.models.custom_import import (
                custom_path_hint,  # imports the user's module: only on an error
            )

            raise ValueError(f'expected "package.module:factory", got {v!r}{custom_path_hint(v)}')
        return v

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


# The keys a user's own model (``model.custom``) does not read: the model families' own.
FAMILY_ONLY_KEYS = frozenset(ModelConfig.model_fields) - frozenset(CUSTOM_MODEL_READS)


class MixSource(Section):
    """One source of ``data.mix``: what it reads and its share of the training tokens. Every source is
    read with ``data.tokenizer``; its windows are cut as a lone source's would be."""

    source: Literal["builtin", "text", "tokens", "documents"] = "documents"
    paths: StrList = Field(default_factory=list, description="files, folders or globs, as data.paths")
    text_field: str = Field("text", min_length=1, description="documents: the column holding each document's text")
    weight: float = Field(description="its share of the training tokens, relative to the other sources' (> 0); "
                          "0.7 and 0.3 read 70% and 30% of the windows")


class DataConfig(Section):
    source: Literal["builtin", "synthetic", "text", "tokens", "documents"] = "builtin"
    # builtin: a corpus every machine has without downloading (the Python standard library's source).
    builtin: Literal["python-stdlib"] = "python-stdlib"
    paths: StrList = Field(default_factory=list, description="files, folders or globs for text / tokens / "
                           "documents (documents: .jsonl .json .parquet .csv .arrow and save_to_disk folders)")
    text_field: str = Field("text", min_length=1, description="documents: the column holding each document's text")
    format: Literal["text", "chat"] = Field(
        "text", description="documents: text = one document per record; chat = a list of {role, content} "
        "messages per record, rendered with the tokenizer's chat template")
    messages_field: str = Field("messages", min_length=1, description="format = chat: the column holding the messages")
    loss_on: Literal["assistant", "all"] = Field(
        "assistant", description="format = chat: assistant = only the assistant's tokens are in the loss")
    packing: Literal["concat", "document"] = Field(
        "concat", description="concat: documents run together in each window (pretraining); document: no "
        "token attends across a document boundary and positions restart at each document (fine-tuning)")
    mix: list[MixSource] = Field(
        default_factory=list, description="several sources, each with a weight (its share of the training "
        "tokens); replaces data.source and data.paths when set")
    tokenizer: str = Field("byte", min_length=1, description="byte (built in); a tokenizer.json or a folder "
                           "holding one (the tokenizers library); hf = model.hf's folder")
    max_bytes: PositiveInt | None = Field(64 * 2**20, description="cap on text read (builtin/text)")
    shuffle: bool = True
    seed: int | None = Field(None, description="None = train.seed")


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: Annotated[float, Field(gt=0)] = 1e-3
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    eps: Annotated[float, Field(gt=0)] = 1e-8
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    # auto: fused where the device supports it, else foreach.
    impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"


class LRScheduleConfig(Section):
    name: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: NonNegativeInt = 0
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1


class ActivationCheckpointConfig(Section):
    # selective: every block keeps its input, every second matmul's and attention's outputs and
    # recomputes the rest in backward (accelrun.dist.selective_checkpoint)
    mode: Literal["none", "full", "every_n", "selective"] = "none"
    every_n: PositiveInt = 2


CpuMalloc = Literal["blocks", "tuned", "lean", "system"]  # train.cpu_malloc: accelrun.train.host_malloc


class TrainConfig(Section):
    steps: PositiveInt = 300
    global_batch: PositiveInt = 16
    micro_batch: PositiveInt | None = Field(
        None, description="sequences per data-parallel rank per forward; None = global_batch / dp (no accumulation)"
    )
    grad_accum: PositiveInt | None = Field(None, description="None = global_batch / (micro_batch × dp)")
    seq_len: PositiveInt = 256
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig)
    grad_clip: Annotated[float, Field(ge=0)] | None = Field(1.0, description="max grad norm; null or 0 = no clipping")
    seed: int = 0
    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    activation_checkpoint: ActivationCheckpointConfig = Field(default_factory=ActivationCheckpointConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: PositiveInt | None = Field(None, description="CPU threads for torch; None = torch's default")
    cpu_malloc: CpuMalloc = Field(
        "blocks", description="on a CPU: blocks = accelrun's allocator: blocks from 1 MiB up are mapped once and "
        "reused by size, mapped memory within 1.25x the most its live blocks held at once "
        "(accelrun.train.host_blocks; glibc as tuned for the rest; built by g++, tuned where it cannot be); tuned = glibc keeps freed activations for the next "
        "step, and the heap's free pages go back to the OS only after the first step and after a step that grew "
        "the heap (accelrun.train.host_malloc); lean = memory first: blocks from 16 MiB up are mapped afresh and "
        "the free pages go back after every step; system = glibc's defaults. torchtitan's debug shape, fp32: "
        "blocks 1.72 GiB (2,236 tokens/s, 1.52x torchtitan's), tuned 2.18, lean 1.46 (1.36x and 1.16x)")
    float8: bool = Field(
        False, description="CUDA only (H100 or newer): the blocks' linear layers compute in float8 with dynamic "
        "scaling (torchao's convert_to_float8_training; pip install 'accelrun[float8]'); the output head and "
        "layers whose dims are not multiples of 16 stay as they are (accelrun.dist.float8)")


# Stages per pipeline rank each schedule runs unless parallel.pp_stages_per_rank says otherwise: the
# interleaved ones loop several ("virtual") stages over the ranks, rank r holding r, r + pp, ...
PP_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}
INTERLEAVED_SCHEDULES = tuple(k for k, v in PP_STAGES_PER_RANK.items() if v > 1)
# The device mesh's dimensions, outermost first: tensor parallelism innermost (neighbouring ranks, one
# node's links), then context parallelism (its K/V all-gathers every layer want fast links too),
# pipeline stages outermost. accelrun.dist.mesh builds it; accelrun.plan.comm reads it.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelConfig(Section):
    nnodes: PositiveInt = 1
    nproc_per_node: PositiveInt = 1
    dp_replicate: Degree = 1
    dp_shard: Degree = -1
    tp: Degree = 1
    pp: Degree = 1
    cp: Degree = Field(1, description="context parallelism: each sequence split over this many ranks "
                       "(each holds a head and a tail chunk; keys and values all-gathered per layer)")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    microbatches: PositiveInt | None = Field(None, description="pipeline micro-batches; None = pp")
    pp_stages_per_rank: PositiveInt | None = Field(
        None, description="interleaved schedules: stages each pipeline rank runs (pp × this many in all; "
        "Meta's Llama 3 405B looped 126 layers over 16 ranks this way); None = 2, or 1 for gpipe and 1f1b"
    )
    ep: PositiveInt = Field(
        1, description="expert parallelism (model.arch = moe): experts spread over this many of the data-parallel "
        "ranks (dp_shard, × cp), tokens sent to them by all-to-all; not a mesh dimension of its own")
    reshard_after_forward: bool = Field(True, description="FSDP: free gathered block parameters after forward")
    fsdp_impl: Literal["fsdp2", "compiled"] = Field(
        "fsdp2", description="fsdp2: FSDP2's hooks gather and reduce outside any graph; compiled: the model is one "
        "accelrun graph whose all-gathers and reduce-scatters the compiler buckets and schedules (needs "
        "compile.backend = accelrun)"
    )
    timeout_s: PositiveInt = Field(
        600, description="a training step's collective that waits longer fails, naming its step and phase"
    )
    init_timeout_s: PositiveInt = Field(
        1800, description="joining the job and setting up (rendezvous, process groups, building and loading the "
        "model, resuming) may take this long before a rank gives up waiting for the others"
    )
    sequence_parallel: bool = Field(
        False, description="TP: shard the norms and the residual stream along the sequence (needs tp > 1)"
    )
    loss_parallel: bool = Field(
        False, description="TP: cross-entropy on vocabulary-sharded logits, never gathered (needs tp > 1)"
    )
    async_tp: bool = Field(
        False, description="CUDA only: overlap TP's all-gathers and reduce-scatters with the matmuls that use them "
        "(Inductor's micro-pipeline pass over symmetric memory; needs tp > 1 and compile.backend = inductor; "
        "accelrun.dist.async_tp)"
    )
    pp_layers: list[list[NonNegativeInt]] | None = Field(
        None, description="the layers of each pipeline stage, in order, e.g. [[0, 1], [2, 3]]; None = balanced"
    )

    @field_validator("pp_layers")
    @classmethod
    def _pp_layers_cover_each_layer_once_in_order(cls, v: list[list[int]] | None) -> list[list[int]] | None:
        if v is None:
            return v
        if len(v) < 2:
            raise ValueError(f"expected one list of layers per pipeline stage (at least 2), got {len(v)}")
        empty = [i for i, stage in enumerate(v) if not stage]
        if empty:
            raise ValueError(f"stage {empty[0]} has no layers; every stage needs at least one")
        flat = [layer for stage in v for layer in stage]
        if flat != list(range(len(flat))):
            twice = sorted({layer for layer in flat if flat.count(layer) > 1})
            missing = sorted(set(range(max(flat) + 1)) - set(flat)) if flat and min(flat) >= 0 else []
            what = (f"layer {twice[0]} is in more than one stage" if twice else
                    f"layer {missing[0]} is in no stage" if missing else "the layers are out of order")
            raise ValueError(f"{what}: expected each layer once, in order (stages are contiguous slices of the "
                             "model, e.g. [[0, 1], [2, 3]])")
        return v

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def degrees(self) -> dict[str, int]:
        """The mesh degrees (MESH_ORDER) with a -1 replaced by what the world size leaves (validated first)."""
        named = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                 "tp": self.tp}
        known = 1
        for v in named.values():
            if v != -1:
                known *= v
        return {k: (self.world_size // known if v == -1 else v) for k, v in named.items()}

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pipeline rank runs: the schedule's default, or ``pp_stages_per_rank`` for the
        interleaved schedules (validate refuses it with the others)."""
        if self.pp_schedule not in INTERLEAVED_SCHEDULES:
            return 1
        return self.pp_stages_per_rank or PP_STAGES_PER_RANK[self.pp_schedule]

    @property
    def dp(self) -> int:
        d = self.degrees()
        return d["dp_replicate"] * d["dp_shard"]


class CompileConfig(Section):
    backend: Literal["eager", "inductor", "accelrun"] = "eager"
    # block: compile each transformer block (one graph reused for identical blocks); model: the whole
    # model and its loss as one graph; loss: the blocks as with block, plus the output head and the
    # loss as a graph of their own (where accelrun fuses linear + cross-entropy); auto: what suits the
    # model and backend (accelrun.compile.compile_model.resolve_scope: loss for a family under accelrun).
    scope: Literal["auto", "block", "model", "loss"] = "auto"
    fullgraph: bool = False
    # The settings below are read by the accelrun backend only.
    passes: str | list[str | dict[str, Any]] = Field(
        "default", description="a preset (none, default, max), one less some of its passes (default-remat), or an "
        "ordered list of passes, each a name or {name: options}; `accelrun compile passes` lists them"
    )
    executors: list[str] = Field(
        ["cpp", "triton", "aten"],
        description="who runs fusion regions, in priority order: cpp takes CPU tensors, triton CUDA ones, "
        "inductor hands regions to Inductor, aten (the fallback) runs them op by op",
    )
    cache_dir: str | None = Field(
        None, description="compiled artifacts; None = $ACCELRUN_CACHE_DIR/compile or ~/.cache/accelrun/compile"
    )
    debug_numerics: bool = Field(
        False, description="run each pass's graph before and after on the same inputs; name the first that diverges"
    )
    dump: bool = Field(False, description="write every pass's graphs and the generated code to <run>/compile/")
    graph_cache: bool = Field(
        True, description="keep compiled graphs (Dynamo + AOTAutograd + passes) on disk: a new process with the "
        "same model, inputs and options loads them instead of tracing again (accelrun backend)"
    )
    strict: bool = Field(
        False, description="make the compiler's fallbacks errors (a pass that raised, skipped for its graph; a "
        "region whose kernel failed to build or at its first call, given to the next executor): for compiler work"
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="replay each compiled forward and backward as a CUDA graph (Inductor's reduce-overhead): "
        "auto = on for CUDA, one rank, static shapes, where a timed replay of a graph beats a timed eager call of it; "
        "on = every graph that can be captured, and one that cannot is a warning; each graph left out says why "
        "(accelrun.compile.cuda_graph_policy)"
    )
    tune_launches: bool = Field(
        True, description="time a few launch configurations (block sizes, warps, stages) of each Triton kernel on "
        "its first compile and keep the fastest beside the kernel's binary (accelrun.compile.codegen.launch_tuning)"
    )

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _on_off_as_yaml_reads_them(cls, v: Any) -> Any:
        # YAML 1.1 (and so `compile.cuda_graphs=on` on the command line) reads on / off as booleans.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("executors")
    @classmethod
    def _executors_named_once(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("list at least one executor (aten runs anything)")
        if len(set(v)) != len(v):
            raise ValueError(f"an executor is listed twice: {v}")
        return v


class CheckpointConfig(Section):
    enabled: bool = Field(True, description="write checkpoints (resume reads them either way)")
    every: PositiveInt = 100
    keep: PositiveInt = 2
    # auto: continue from the newest complete checkpoint of an earlier run with the same name.
    resume: str = Field("auto", description='"auto", "none", or a path to a checkpoint folder')
    save_final: bool = True
    hf_on_finish: bool = Field(
        False, description="after training, export the final checkpoint to <run>/hf/ in Hugging Face format "
        "(needs enabled and save_final)"
    )

    @model_validator(mode="after")
    def _hf_export_needs_a_final_checkpoint(self) -> CheckpointConfig:
        if self.hf_on_finish and not (self.enabled and self.save_final):
            raise ValueError("hf_on_finish exports the final checkpoint: it needs enabled and save_final true")
        return self


class ReportConfig(Section):
    runs_dir: str = "runs"
    log_every: PositiveInt = Field(10, description="steps between progress lines (the bar redraws at every host read, report.read_every)")
    read_every: PositiveInt | None = Field(
        None,
        description="steps between host reads of the loss, gradient norm and step timings (one device "
        "synchronisation each); None: every step on a CPU (its work is done when a call returns, so reading "
        "costs nothing), report.log_every on an accelerator. Metrics lines, divergence checks and the "
        "agreement to stop on a signal happen at these reads (and before checkpoints, evaluations and the "
        "last step), so a preemption's grace period must cover read_every steps",
    )
    warmup_steps: NonNegativeInt = Field(3, description="steps left out of steady-state figures")
    peak_tflops: Annotated[float, Field(gt=0)] | None = Field(
        None, description="declared per-device peak (TFLOP/s) for MFU; None = measured or known table"
    )
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    profile_steps: tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="[first, last] steps (inclusive) to record a torch profiler trace of, into profile/"
    )
    trackers: Annotated[list[Literal["tensorboard", "wandb", "mlflow"]], BeforeValidator(_one_as_list)] = Field(
        default_factory=list,
        description="experiment trackers fed from rank 0 (files inside the run folder; W&B offline)",
    )
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI; None = a file store in <run>/mlflow")

    @field_validator("profile_steps")
    @classmethod
    def _profile_range_is_ordered(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and v[0] > v[1]:
            raise ValueError("expected [first, last] with first <= last")
        return v


PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]


class EvalConfig(Section):
    """Validation loss on a held-out tail of the data that training never reads, or on files of your own."""

    every: NonNegativeInt = Field(0, description="steps between evaluations (and after the last step); 0 = off")
    steps: PositiveInt = Field(4, description="micro-batches per rank in one evaluation (at most the held-out ones)")
    split: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.05, description="fraction of the data's windows held out (the last ones) when eval.every > 0"
    )
    paths: StrList = Field(default_factory=list, description=(
        "files, folders or globs of your own validation data, read as data.paths is (data.source, its format "
        "and tokenizer); training then reads all of data.paths (eval.split is not used)"))


class CollectiveFit(Section):
    """One collective's cost on a link, ``latency + bytes / bandwidth`` (ring bus bandwidth, per hop)."""

    bandwidth_gbs: PositiveFloat
    latency_us: NonNegativeFloat


class LinkConfig(Section):
    """One class of link between devices: within a node, or between nodes."""

    bandwidth_gbs: PositiveFloat | None = Field(
        None, description="GB/s per device in each direction, as a ring collective's bus bandwidth sees it"
    )
    latency_us: NonNegativeFloat = Field(5.0, description="per message hop, microseconds")
    measured: bool = Field(False, description="bandwidth is an achieved bus bandwidth (calibration), not a line rate")
    # Measured per collective by `accelrun plan --calibrate` (gloo's reduce-scatter is slower than its
    # all-gather); a collective named here uses its own figures instead of bandwidth_gbs/latency_us.
    collectives: dict[Literal["all_gather", "reduce_scatter", "all_reduce"], CollectiveFit] = Field(
        default_factory=dict
    )


class CalibrationConfig(Section):
    """Rates measured on a real machine by `accelrun plan --calibrate`; they replace datasheet figures."""

    measured_at: str | None = None
    host: str | None = None
    device_name: str | None = Field(None, description="the GPU measured, as CUDA names it; None for a CPU")
    torch: str | None = None
    threads_per_device: PositiveInt | None = None
    others_cpu_share: float | None = Field(
        None, ge=0, le=1, description="the share of the CPU other processes used while it was measured, where "
                                      "that was enough to lower its rates (every plan made from it says so)")
    # precision → {matrix width: achieved TFLOP/s}, from (rows × width) @ (width × width) products.
    matmul_tflops: dict[Literal["fp32", "bf16"], dict[PositiveInt, PositiveFloat]] = Field(default_factory=dict)
    # precision → {sequence length: achieved TFLOP/s} of causal attention (forward + backward, FLOPs
    # it executes).
    attention_tflops: dict[Literal["fp32", "bf16"], dict[PositiveInt, PositiveFloat]] = Field(default_factory=dict)
    attention_head_dim: PositiveInt = Field(64, description="head dimension of the attention_tflops probes")
    # precision → {head dimension: achieved TFLOP/s} at sequence length attention_head_dim_seq: scales
    # the curve above to a model's head dimension (a fused kernel is slower per FLOP on narrow heads).
    attention_head_dim_tflops: dict[Literal["fp32", "bf16"], dict[PositiveInt, PositiveFloat]] = Field(
        default_factory=dict
    )
    attention_head_dim_seq: PositiveInt | None = None
    memory_bandwidth_gbs: PositiveFloat | None = Field(None, description="streaming elementwise kernels")
    runtime_gib: NonNegativeFloat | None = Field(None, description="a process's memory before it trains")


class ClusterConfig(Section):
    """The machines a recipe is planned for (`accelrun plan`); training does not read it."""

    device: str | None = Field(
        None, description="accelerator kind (`accelrun plan --devices`), cpu or custom; None = no cluster"
    )
    devices_per_node: PositiveInt = 1
    nodes: PositiveInt = 1
    memory_gib: PositiveFloat | None = Field(None, description="per device; None = the accelerator table's")
    memory_bandwidth_gbs: PositiveFloat | None = Field(None, description="per device; None = the table's")
    bf16_tflops: PositiveFloat | None = Field(None, description="dense per-device peak; None = the table's")
    fp32_tflops: PositiveFloat | None = Field(None, description="dense per-device peak; None = the table's")
    reserved_gib: NonNegativeFloat | None = Field(
        None, description="per-device memory tensors cannot use (runtime, communicators); None = per kind"
    )
    intra_node: LinkConfig = Field(default_factory=LinkConfig)
    inter_node: LinkConfig = Field(default_factory=LinkConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    sources: dict[str, str] = Field(
        default_factory=dict, description="figure → where it comes from, or that it is an assumption"
    )


class RunConfig(Section):
    name: Annotated[str, Field(pattern=RUN_NAME_PATTERN)] = "run"
    description: str = ""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @property
    def grad_accum(self) -> int:
        t = self.train
        return t.grad_accum or t.global_batch // (t.micro_batch * self.parallel.dp)

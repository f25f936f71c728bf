"""Which recipe keys the planner models, which cannot change a step's memory or time, and which it
cannot model (named in every plan they apply to, never silently ignored).

Every leaf key of the schema is in exactly one of the three tables; ``tests/plan/test_plan_keys.py``
fails when a key is added to the schema without being classified here.
"""

from __future__ import annotations

from accelrun.config.schema import RunConfig

# Read by accelrun.plan (workload, memory, timing, cluster).
MODELLED = frozenset({
    "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim", "model.vocab_size",
    "model.tie_embeddings", "model.custom",  # custom: refused with a message (no shape to count)
    "model.arch", "model.head_dim",  # the family's shape module (accelrun.models.families.<arch>.shape)
    # moe (accelrun.plan.moe): active width for time and FLOPs, every expert for memory
    "model.n_experts", "model.experts_per_token", "model.moe_ffn_dim", "model.shared_expert_ffn_dim",
    "parallel.ep",  # all-to-all per MoE layer, whole experts per rank, an assumed imbalance
    "train.global_batch", "train.micro_batch", "train.grad_accum", "train.seq_len", "train.optimizer.impl",
    "train.grad_clip", "train.precision", "train.activation_checkpoint.mode", "train.activation_checkpoint.every_n",
    "train.threads",  # compared with the calibration's threads (a note when they differ)
    "parallel.nnodes", "parallel.nproc_per_node", "parallel.dp_replicate", "parallel.dp_shard", "parallel.tp",
    "parallel.pp", "parallel.pp_schedule", "parallel.microbatches", "parallel.reshard_after_forward",
    "parallel.fsdp_impl", "parallel.sequence_parallel", "parallel.loss_parallel", "parallel.pp_layers",
    "parallel.pp_stages_per_rank",  # the interleaved schedules' bubble and in-flight micro-batches
    "parallel.cp",  # tokens per rank, gathered keys/values (accelrun.plan.context_parallel)
    "compile.backend",
    "cluster.device", "cluster.devices_per_node", "cluster.nodes", "cluster.memory_gib",
    "cluster.memory_bandwidth_gbs", "cluster.bf16_tflops", "cluster.fp32_tflops", "cluster.reserved_gib",
    "cluster.intra_node.bandwidth_gbs", "cluster.intra_node.latency_us", "cluster.intra_node.measured",
    "cluster.intra_node.collectives", "cluster.inter_node.bandwidth_gbs", "cluster.inter_node.latency_us",
    "cluster.inter_node.measured", "cluster.inter_node.collectives", "cluster.calibration.threads_per_device",
    "cluster.calibration.matmul_tflops", "cluster.calibration.attention_tflops",
    "cluster.calibration.attention_head_dim", "cluster.calibration.attention_head_dim_tflops",
    "cluster.calibration.attention_head_dim_seq", "cluster.calibration.memory_bandwidth_gbs",
    "cluster.calibration.runtime_gib",
})

# Cannot change one training step's memory or time on the device.
NO_EFFECT = frozenset({
    "name", "description", "model.norm_eps", "model.rope_theta", "model.init_std", "model.kwargs",
    "model.max_seq_len",  # the rotary table: max_seq_len × head_dim / 2 numbers, negligible
    "model.rope_scaling",  # changes the rotary table's values, not its size
    "model.qkv_bias",  # (n_heads + 2 kv_heads) × head_dim numbers per layer, negligible
    "model.hf",  # the folder's shape is in the other model keys; reading it happens before the first step
    "model.aux_loss_coef",  # one scalar multiply of the load-balancing loss
    "checkpoint.hf_on_finish",  # after the last step
    "data.source", "data.builtin", "data.paths", "data.tokenizer", "data.max_bytes", "data.shuffle", "data.seed",
    "data.text_field", "data.format", "data.messages_field",
    "data.loss_on",  # which targets count in the loss; every token is still computed
    "data.mix",  # which windows are read, not their shape
    "train.steps", "train.seed", "train.optimizer.name", "train.optimizer.lr", "train.optimizer.betas",
    "train.optimizer.eps", "train.optimizer.weight_decay", "train.lr_schedule.name",
    "train.lr_schedule.warmup_steps", "train.lr_schedule.min_lr_ratio",
    "parallel.timeout_s", "parallel.init_timeout_s", "compile.cache_dir", "compile.dump", "compile.graph_cache", "compile.fullgraph",
    "compile.strict", "checkpoint.keep", "checkpoint.resume", "report.runs_dir", "report.log_every",
    "report.warmup_steps", "report.progress",
    "report.peak_tflops",  # the trainer's MFU denominator; the plan's MFU uses the cluster's peak
    "report.trackers", "report.mlflow_uri",  # rank 0 copies each step's record after it is timed
    "eval.every", "eval.steps", "eval.split", "eval.paths",  # evaluation runs after the step's timing, outside it
    "cluster.calibration.measured_at", "cluster.calibration.host", "cluster.calibration.device_name",
    "cluster.calibration.torch", "cluster.calibration.others_cpu_share", "cluster.sources",
})

# Change memory or time in ways the planner does not model; ``unmodelled`` says when they apply.
UNMODELLED = frozenset({
    "compile.passes", "compile.executors", "compile.scope", "compile.debug_numerics",
    "compile.cuda_graphs", "compile.tune_launches",  # fewer launches, faster kernels: on a GPU, not planned
    "checkpoint.enabled", "checkpoint.every", "checkpoint.save_final", "report.profile_steps",
    "report.read_every",  # how often the host waits for the device: planned as never
    "train.device", "train.cpu_malloc",
    "model.capacity_factor",  # dropped assignments skip their expert: planned as none dropped
    "data.packing",  # document: block-causal attention skips cross-document blocks; planned as causal
    "train.float8",  # float8 matmuls: planned at the precision's (bf16) rates and bytes
    "parallel.async_tp",  # TP's collectives overlapped with matmuls: planned as TP without it
})


def unmodelled(cfg: RunConfig) -> list[str]:
    """One line per key of ``UNMODELLED`` that matters for this recipe: the key, its value, what is missed."""
    out: list[str] = []
    c, t = cfg.compile, cfg.train
    if c.backend == "accelrun":
        out.append(f"compile.passes = {c.passes!r}, compile.executors = {c.executors}: accelrun's compiler is "
                   "planned as fused elementwise kernels (as inductor), what a block keeps under its "
                   "rematerialisation as a counted share of Inductor's (Llama blocks without tensor parallelism), "
                   "its fused loss chunk by chunk; its collective scheduling and its executors' speed are not "
                   "modelled")
        if c.debug_numerics:
            out.append("compile.debug_numerics = true: every pass's graphs run twice; not in the step time")
        if cfg.cluster.device not in (None, "cpu") and (c.cuda_graphs != "off" or c.tune_launches):
            out.append(f"compile.cuda_graphs = {c.cuda_graphs}, compile.tune_launches = {c.tune_launches}: the "
                       "launches CUDA graphs save and the tuned kernels' speed are not modelled")
    if c.backend != "eager" and c.scope not in ("block", "auto"):
        out.append(f"compile.scope = {c.scope}: planned as per-block compilation")
    elif c.backend == "accelrun" and c.scope == "auto":  # resolve_scope: a family's head compiles too
        out.append("compile.scope = auto (loss: the blocks and the loss head under accelrun): planned as "
                   "per-block compilation, with the head's fused loss in memory")
    if cfg.checkpoint.enabled:
        out.append(f"checkpoint.every = {cfg.checkpoint.every}: writing a checkpoint is not in the step time"
                   + (" (nor checkpoint.save_final's)" if cfg.checkpoint.save_final else ""))
    if cfg.report.profile_steps is not None:
        out.append(f"report.profile_steps = {list(cfg.report.profile_steps)}: the profiler's overhead on those "
                   "steps is not modelled")
    on_accelerator = t.device == "cuda" or (t.device == "auto" and cfg.cluster.device not in (None, "cpu"))
    if cfg.report.read_every is not None and on_accelerator:
        out.append(f"report.read_every = {cfg.report.read_every}: the host waits for the device once every "
                   f"{cfg.report.read_every} step(s); planned as a host that never waits")
    if cfg.model.arch == "moe" and cfg.model.capacity_factor is not None:
        out.append(f"model.capacity_factor = {cfg.model.capacity_factor}: planned as if no token were dropped "
                   "(dropped assignments skip their expert's matmuls and all-to-alls)")
    if cfg.data.packing == "document":
        out.append("data.packing = document: attention is planned as causal over the whole window; attention "
                   "restricted to each document costs less, by how much depends on the documents' lengths")
    if t.float8:
        out.append("train.float8 = true: float8 is not modelled; the plan is for the linear layers in "
                   f"{t.precision} (float8 matmuls run up to twice bf16's rate, and their casts and scales are extra "
                   "memory traffic)")
    if cfg.parallel.async_tp:
        out.append("parallel.async_tp = true: the overlap of tensor parallelism's collectives with its matmuls is "
                   "not modelled; planned as TP without it")
    device = cfg.cluster.device
    if t.device != "auto" and device is not None and (t.device == "cpu") != (device == "cpu"):
        out.append(f"train.device = {t.device} on a {device} cluster: planned on the cluster's devices")
    if device == "cpu" and t.cpu_malloc not in ("blocks", "tuned"):
        out.append(f"train.cpu_malloc = {t.cpu_malloc}: the calibration's allocator behaviour is assumed")
    return out


def schema_leaves() -> list[str]:
    """Every leaf key of the recipe schema, dotted."""
    from pydantic import BaseModel

    def walk(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                out += walk(ann, f"{prefix}{name}.")
            else:
                out.append(prefix + name)
        return out

    return walk(RunConfig, "")

"""One prediction: memory, step time, throughput and MFU of a recipe on a cluster, and a verdict.

Example::

    resolved = load_plan_config("configs/llama.yaml", [], cluster="cpu-local.yaml")
    plan = predict(resolved.config)
    print(plan.verdict, plan.step_s, plan.tokens_per_s_per_device)
"""

from __future__ import annotations

from dataclasses import dataclass

from accelrun.config.schema import RunConfig
from accelrun.plan.cluster import Cluster, resolve_cluster
from accelrun.plan.coverage import unmodelled
from accelrun.plan.errors import PlanError
from accelrun.plan.memory import GIB, MemoryEstimate, estimate_memory
from accelrun.plan.timing import StepTime, estimate_time
from accelrun.plan.workload import PlanOptions, Workload, workload_from_config


@dataclass(frozen=True)
class Plan:
    workload: Workload
    cluster: Cluster
    memory: MemoryEstimate
    time: StepTime
    notes: tuple[str, ...] = ()  # what the user should know about the prediction's assumptions
    unmodelled: tuple[str, ...] = ()  # keys of this recipe that change memory or time in ways not modelled

    @property
    def step_s(self) -> float:
        return self.time.total

    @property
    def tokens_per_step(self) -> int:
        return self.workload.global_batch * self.workload.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.workload.layout.world

    @property
    def model_flops_per_token(self) -> float:
        return self.workload.shape.model_flops_per_token(self.workload.seq_len)

    @property
    def achieved_tflops_per_device(self) -> float:
        """Model FLOPs (the MFU convention: no recomputation) per second per device, in TFLOP/s."""
        return self.model_flops_per_token * self.tokens_per_s_per_device / 1e12

    @property
    def mfu(self) -> float | None:
        peak = self.time.rates.peak_tflops
        if not peak:
            return None
        return self.achieved_tflops_per_device / peak

    def layout_summary(self) -> dict:
        """The layout planned, as a saved plan needs it to be audited."""
        w, lay = self.workload, self.workload.layout
        out = {
            "world": lay.world, "nnodes": lay.nnodes, "nproc_per_node": lay.nproc_per_node,
            "pp": lay.pp, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp,
            "sequence_parallel": lay.sequence_parallel, "loss_parallel": lay.loss_parallel,
            "fsdp": lay.fsdp, "reshard_after_forward": lay.reshard_after_forward,
            "global_batch": w.global_batch, "micro_batch": w.micro_batch, "grad_accum": w.grad_accum,
            "seq_len": w.seq_len, "precision": w.precision, "mode": w.mode, "activation_checkpoint": w.ac_mode,
            "compiled": w.compiled,
        }
        if lay.pp > 1:
            out.update(pp_schedule=lay.pp_schedule, pp_microbatches=lay.pp_microbatches,
                       pp_micro_batch_sequences=w.chunk_batch, pp_stage_layers=list(lay.stage_layers),
                       pp_rank_layers=[lay.rank_layers(r) for r in range(lay.pp)])
        return out

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def verdict(self) -> str:
        m = self.memory
        if m.fits:
            return f"fits: {m.total / GIB:.1f} GiB of {m.capacity / GIB:.1f} GiB per device"
        big = m.largest
        return (f"does not fit: needs {m.total / GIB:.1f} GiB, device has {m.capacity / GIB:.1f} GiB; "
                f"largest term: {big.name} {big.bytes / GIB:.1f} GiB ({big.detail})")


def predict(cfg: RunConfig, options: PlanOptions | None = None, cluster: Cluster | None = None) -> Plan:
    """Plan one validated recipe on its ``cluster`` section (or on ``cluster``, already resolved)."""
    cluster = cluster or resolve_cluster(cfg.cluster, cfg.parallel.nproc_per_node)
    w = workload_from_config(cfg, options)
    check_fits_cluster(w, cluster)
    time = estimate_time(w, cluster)
    notes = _notes(cfg, w, cluster)
    if not cluster.is_cpu and time.total < LAUNCH_BOUND_BELOW_S:
        notes += (launch_bound_note(time.total),)
    return Plan(w, cluster, estimate_memory(w, cluster), time, notes, tuple(unmodelled(cfg)))


# Below this planned step a GPU step is set by its kernel launches, which the plan does not count: the
# debug model, planned at 1.5 ms a step on an H100, took 9.5 ms eager and 6.4 with CUDA graphs on an H200.
LAUNCH_BOUND_BELOW_S = 0.02


def launch_bound_note(step_s: float) -> str:
    return (f"a planned step of {step_s * 1e3:.3g} ms is launch-bound on a GPU: the kernels' launches (several "
            "microseconds each, hundreds a step) are not modelled, so the step is longer and MFU lower than "
            "above (the debug model: planned 1.5 ms on an H100, measured 9.5 ms eager and 6.4 ms with CUDA "
            "graphs on an H200, docs/gpu.md)")


def _notes(cfg: RunConfig, w: Workload, cluster: Cluster) -> tuple[str, ...]:
    notes = []
    measured = cluster.config.calibration.threads_per_device
    if measured is not None and cfg.train.threads is not None and cfg.train.threads != measured:
        notes.append(f"train.threads = {cfg.train.threads}, but the calibration measured {measured} thread(s) per "
                     "device: the predicted rates are for the latter")
    if w.shape.family != "llama":
        notes.append(f"model.arch = {w.shape.family}: FLOPs, parameters, matmuls and attention's width are its "
                     "own; its norms' and feed-forward's saved bytes and traffic per token use the coefficients "
                     "counted on Llama's block")
    if w.layout.cp > 1:
        from accelrun.plan.context_parallel import cp_gather_s, gathered_kv_bytes

        notes.append(f"context parallel {w.layout.cp}: each rank receives {gathered_kv_bytes(w) / 2**20:.3g} MiB of "
                     f"keys/values per layer and micro-batch ({cp_gather_s(w, cluster) * 1e3:.3g} ms all-gather, the "
                     "same back as a reduce-scatter in backward), not overlapped: attention waits for it; the rest "
                     f"of the activations is 1/{w.layout.cp} of one rank's")
    devices = cluster.nodes * cluster.devices_per_node
    if w.layout.world < devices:  # "on 4 x 8 h100-sxm" above, while the job takes fewer
        notes.append(f"the recipe's job uses {w.layout.world} of the cluster's {devices} devices "
                     f"(parallel.nnodes {w.layout.nnodes} × parallel.nproc_per_node {w.layout.nproc_per_node}); "
                     "set those keys for more, or --search for the best layout on all of them")
    if cfg.parallel.fsdp_impl == "compiled" and w.layout.fsdp:
        notes.append("parallel.fsdp_impl = compiled: planned with reshard_after_forward false's memory and "
                     "gathers (the graph keeps gathered parameters for backward), overlapped as FSDP2's prefetch")
    return tuple(notes)


def check_fits_cluster(w: Workload, cluster: Cluster) -> None:
    lay = w.layout
    if lay.nproc_per_node <= cluster.devices_per_node and lay.nnodes > cluster.nodes:
        # The cluster's size is the description's to say; a recipe for more nodes is not wrong.
        raise PlanError(
            f"the recipe runs on parallel.nnodes = {lay.nnodes} nodes, but the cluster description has "
            f"cluster.nodes = {cluster.nodes}; give the cluster's node count (e.g. cluster.nodes={lay.nnodes} "
            "on the command line)"
        )
    if lay.nproc_per_node > cluster.devices_per_node:
        raise PlanError(
            f"the recipe runs parallel.nnodes × parallel.nproc_per_node = {lay.nnodes} × {lay.nproc_per_node} "
            f"processes, the cluster has cluster.nodes × cluster.devices_per_node = {cluster.nodes} × "
            f"{cluster.devices_per_node} devices; set the parallel keys to fit (or use --search), or, where the "
            f"machine has them, the cluster's (cluster.devices_per_node={lay.nproc_per_node} on the command line: "
            "a CPU's processes on cluster/cpu-local)"
        )

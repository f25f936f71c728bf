"""One prediction: memory, step time, throughput and MFU of a recipe on a cluster, and a verdict.

Example::

    resolved = load_plan_config("configs/llama.yaml", [], cluster="cpu-local.yaml")
    plan = predict(resolved.config)
    print(plan.verdict, plan.step_s, plan.tokens_per_s_per_device)
"""

from __future__ import annotations

from dataclasses import dataclass

from accelrun.config.schema import RunConfig
from accelrun.plan.cluster import Cluster, PlanError, resolve_cluster
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
    def mfu(self) -> float | None:
        peak = self.time.rates.peak_tflops
        if not peak:
            return None
        return self.model_flops_per_token * self.tokens_per_s_per_device / (peak * 1e12)

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
    cluster = cluster or resolve_cluster(cfg.cluster)
    w = workload_from_config(cfg, options)
    check_fits_cluster(w, cluster)
    return Plan(w, cluster, estimate_memory(w, cluster), estimate_time(w, cluster), _notes(cfg, w, cluster))


def _notes(cfg: RunConfig, w: Workload, cluster: Cluster) -> tuple[str, ...]:
    notes = []
    measured = cluster.config.calibration.threads_per_device
    if measured is not None and cfg.train.threads is not None and cfg.train.threads != measured:
        notes.append(f"train.threads = {cfg.train.threads}, but the calibration measured {measured} thread(s) per "
                     "device: the predicted rates are for the latter")
    if w.ac_mode == "selective":
        notes.append("selective checkpointing is modelled by the planner only; accelrun train cannot run it yet")
    return tuple(notes)


def check_fits_cluster(w: Workload, cluster: Cluster) -> None:
    lay = w.layout
    if lay.nproc_per_node > cluster.devices_per_node or lay.nnodes > cluster.nodes:
        raise PlanError(
            f"the recipe runs parallel.nnodes × parallel.nproc_per_node = {lay.nnodes} × {lay.nproc_per_node} "
            f"processes, the cluster has cluster.nodes × cluster.devices_per_node = {cluster.nodes} × "
            f"{cluster.devices_per_node} devices; set the parallel keys to fit (or use --search)"
        )

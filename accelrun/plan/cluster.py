"""A cluster description, resolved: each device's memory and rates, the links between devices.

The recipe's ``cluster`` section (``accelrun.config.schema.ClusterConfig``) names an accelerator
kind (``accelrun.plan.accelerators``) and may override any figure; ``cpu`` and ``custom`` declare
theirs, or carry rates measured by ``accelrun plan --calibrate``. Datasheet figures are scaled by
the fixed constants in ``accelrun.plan.efficiency``; measured figures are used as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from accelrun.config.errors import nearest
from accelrun.config.schema import ClusterConfig, LinkConfig
from accelrun.plan import efficiency as eff
from accelrun.plan.accelerators import DECLARED_KINDS, find_accelerator, known_kinds
from accelrun.plan.errors import PlanError

PRECISION_KEY = {"fp32": "fp32", "bf16-mixed": "bf16"}
HOW_TO_CALIBRATE = ("measure this machine with `accelrun plan --calibrate --output cluster.yaml` and pass "
                    "--cluster cluster.yaml")


@dataclass(frozen=True)
class Link:
    bandwidth_gbs: float  # achieved bus bandwidth per device, one direction
    latency_s: float
    source: str
    # collective → (bus bandwidth GB/s, per-hop latency s), where measured for that collective
    collectives: dict[str, tuple[float, float]] = field(default_factory=dict)

    def cost(self, collective: str) -> tuple[float, float]:
        """(bytes per second, seconds per hop) of ``collective`` on this link."""
        bw, lat = self.collectives.get(collective, (self.bandwidth_gbs, self.latency_s))
        return bw * 1e9, lat


@dataclass(frozen=True)
class DeviceRates:
    """Achieved rates of one device at one precision."""

    matmul_curve: tuple[tuple[int, float], ...]  # (matrix width, TFLOP/s), by width; one entry = flat
    attention_curve: tuple[tuple[int, float], ...]  # (sequence length, TFLOP/s); one entry = flat
    memory_gbs: float
    peak_tflops: float | None  # what MFU divides by
    peak_source: str
    # (head dimension, TFLOP/s) at one sequence length, and the head dimension attention_curve was
    # measured at: their ratio scales attention_curve to another head dimension. Empty = no scaling.
    head_dim_curve: tuple[tuple[int, float], ...] = ()
    curve_head_dim: int = 64

    def matmul_tflops(self, width: float) -> float:
        """Rate at ``width`` (geometric mean of a product's two weight dims)."""
        return _interpolate(self.matmul_curve, width)

    def attention_tflops(self, seq_len: int, head_dim: int | None = None) -> float:
        rate = _interpolate(self.attention_curve, seq_len)
        if self.head_dim_curve and head_dim is not None:
            rate *= _interpolate(self.head_dim_curve, head_dim) / _interpolate(self.head_dim_curve, self.curve_head_dim)
        return rate


def _interpolate(curve: tuple[tuple[int, float], ...], x: float) -> float:
    """Linear in log(x) between measured points; the end values beyond them."""
    if len(curve) == 1 or x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    for (x0, r0), (x1, r1) in zip(curve, curve[1:], strict=False):
        if x0 <= x <= x1:
            return r0 + math.log(x / x0) / math.log(x1 / x0) * (r1 - r0)
    return curve[-1][1]


@dataclass(frozen=True)
class Cluster:
    device: str
    devices_per_node: int
    nodes: int
    memory_gib: float
    reserved_gib: float
    intra: Link | None
    inter: Link | None
    config: ClusterConfig
    figures: list[tuple[str, str, str]] = field(default_factory=list)  # (figure, value, source)

    @property
    def size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    def describe(self) -> str:
        return f"{self.nodes} × {self.devices_per_node} {self.device}"

    def rates(self, precision: str) -> DeviceRates:
        """Matmul, attention and memory rates at ``precision`` ("fp32" or "bf16-mixed")."""
        c, key = self.config, PRECISION_KEY[precision]
        acc = find_accelerator(self.device)
        declared = c.bf16_tflops if key == "bf16" else c.fp32_tflops
        peak, peak_source = declared, f"cluster.{key}_tflops, declared in the cluster recipe"
        if peak is None and acc is not None:
            entry = acc.peaks
            peak = entry.bf16_tflops if key == "bf16" else entry.fp32_tflops
            peak_source = f"dense {key} peak of {entry.entry}, from accelrun's accelerator table ({entry.cited_for(key)})"
        measured_curve = c.calibration.matmul_tflops.get(key)
        if measured_curve:
            curve = tuple(sorted(measured_curve.items()))
            if peak is None:  # a CPU: the best rate measured, as accelrun's MFU probe does
                peak = max(r for _, r in curve)
                peak_source = f"measured: the best {key} matmul rate of `accelrun plan --calibrate` on this machine"
                if (share := c.calibration.others_cpu_share) is not None:  # every rate it gives is low
                    peak_source += f"; measured while other processes used {share:.0%} of the CPU (rates low)"
        elif peak is not None:
            curve = ((1, peak * eff.MATMUL_OF_PEAK),)
        else:
            raise PlanError(self._missing(f"cluster.{key}_tflops", precision))
        measured_attention = c.calibration.attention_tflops.get(key)
        if measured_attention:
            attention = tuple(sorted(measured_attention.items()))
        elif peak is not None and not measured_curve:
            attention = ((1, peak * eff.ATTENTION_OF_PEAK),)
        else:
            raise PlanError(self._missing(f"cluster.calibration.attention_tflops.{key}", precision))
        by_head_dim = tuple(sorted(c.calibration.attention_head_dim_tflops.get(key, {}).items()))
        if c.calibration.memory_bandwidth_gbs is not None:
            memory = c.calibration.memory_bandwidth_gbs
        else:
            bw = c.memory_bandwidth_gbs or (acc.memory_bandwidth_gbs if acc else None)
            if bw is None:
                raise PlanError(self._missing("cluster.memory_bandwidth_gbs", precision))
            memory = bw * eff.MEMORY_OF_PEAK
        return DeviceRates(curve, attention, memory, peak, peak_source, by_head_dim, c.calibration.attention_head_dim)

    def _missing(self, key: str, precision: str) -> str:
        how = HOW_TO_CALIBRATE if self.device == "cpu" else "declare it in the cluster description"
        return f"cluster.device = {self.device}: no figure for {key} (train.precision = {precision}); {how}"


def resolve_cluster(c: ClusterConfig, processes_per_node: int | None = None) -> Cluster:
    """Check a cluster description and fill in what the accelerator table knows. ``processes_per_node``:
    the recipe's, for the calibration hint of an unmeasured CPU (it names the count to measure)."""
    if c.device is None:
        raise PlanError(
            "no cluster to plan for: pass --cluster NAME (see `accelrun recipes list`, family cluster/), "
            "or a file, or put a `cluster:` section in the recipe"
        )
    if c.device == "cpu" and c.calibration.measured_at is None:
        from accelrun.plan.calibrate import with_cached_calibration  # torch-free

        c = with_cached_calibration(c, processes_per_node)
    acc = find_accelerator(c.device)
    if acc is None and c.device not in DECLARED_KINDS:
        hint = nearest(c.device, known_kinds())
        msg = f"cluster.device = {c.device!r} is not a known accelerator kind"
        msg += f"; did you mean {hint!r}?" if hint else ""
        raise PlanError(msg + f" (kinds: {', '.join(known_kinds())})")
    src = dict(c.sources)
    figures: list[tuple[str, str, str]] = []

    memory = c.memory_gib if c.memory_gib is not None else (acc.memory_gib if acc else None)
    if memory is None:
        raise PlanError(f"cluster.device = {c.device}: cluster.memory_gib is required (per device)"
                        + (f"; {HOW_TO_CALIBRATE}" if c.device == "cpu" else ""))
    if c.memory_gib is None and acc is not None:
        memory_source = acc.source
    else:
        memory_source = src.get("memory_gib", "declared (cluster)")
    figures.append(("memory", f"{memory:g} GiB", memory_source))
    if c.reserved_gib is not None:
        reserved, why = c.reserved_gib, src.get("reserved_gib", "declared (cluster)")
    elif c.device == "cpu":
        reserved = c.calibration.runtime_gib or 0.0
        why = "measured: resident memory of a process that imported accelrun's training stack (calibration)"
    else:
        reserved, why = eff.GPU_RESERVED_GIB, "assumption: CUDA context and communicator buffers"
    figures.append(("reserved (not for tensors)", f"{reserved:g} GiB", why))

    intra = _link(c.intra_node, "intra_node", acc.link_gbs if acc else None, acc.link if acc else None, src)
    inter = _link(c.inter_node, "inter_node", None, None, src)
    if c.devices_per_node > 1 and intra is None:
        raise PlanError(f"cluster.devices_per_node = {c.devices_per_node} needs cluster.intra_node.bandwidth_gbs "
                        f"(no default link for device {c.device})")
    if c.nodes > 1 and inter is None:
        raise PlanError(f"cluster.nodes = {c.nodes} needs cluster.inter_node.bandwidth_gbs (per device, GB/s)")
    for name, link in (("intra-node link", intra), ("inter-node link", inter)):
        if link is not None:
            value = f"{link.bandwidth_gbs:g} GB/s, {link.latency_s * 1e6:g} µs"
            value += "".join(f"; {k.replace('_', '-')} {bw:.3g} GB/s + {lat * 1e6:.0f} µs per hop"
                             for k, (bw, lat) in sorted(link.collectives.items()))
            figures.append((name, value, link.source))
    return Cluster(c.device, c.devices_per_node, c.nodes, float(memory), float(reserved), intra, inter, c, figures)


def _link(cfg: LinkConfig, key: str, default_gbs: float | None, default_what: str | None,
          sources: dict[str, str]) -> Link | None:
    if cfg.bandwidth_gbs is None and default_gbs is None:
        return None
    if cfg.bandwidth_gbs is not None:
        raw, what = cfg.bandwidth_gbs, sources.get(key, "declared (cluster)")
    else:
        raw, what = default_gbs, f"accelerator table: {default_what}"
    if cfg.measured:
        fits = {k: (f.bandwidth_gbs, f.latency_us * 1e-6) for k, f in cfg.collectives.items()}
        return Link(raw, cfg.latency_us * 1e-6, f"measured bus bandwidth: {what}", fits)
    return Link(raw * eff.NETWORK_OF_PEAK, cfg.latency_us * 1e-6,
                f"{raw:g} GB/s × NETWORK_OF_PEAK {eff.NETWORK_OF_PEAK}: {what}")

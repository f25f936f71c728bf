"""Mixture of experts in the plan: the shape's two parameter counts, and expert parallelism's
all-to-all time and imbalance.

Shape (:class:`MoEShape`): a token multiplies attention, the router and its ``k`` routed experts
(plus the shared one), so the matmuls the timing model runs (``block_gemms``) are Llama's with a
feed-forward ``k·moe_ffn_dim + shared`` wide, plus the router; the parameters memory holds
(``weight_gemms``) are every expert's. FLOPs per token count active parameters (``Shape.model_flops_per_token`` on
``active_param_count``), so the plan's MFU is on active parameters too.

Expert parallelism (``parallel.ep``, ranks carved out of dp_shard: consecutive ranks, so the
dp_shard link): each MoE layer's forward sends every routed (token, choice) row to the rank holding
its expert and back, two all-to-alls of ``tokens · k · dim`` elements per rank; backward repeats
both (and full recomputation both again). With experts spread evenly and routing uniform, a rank
keeps ``1/ep`` of its rows and exchanges the rest: ``(ep−1)/ep · tokens · k · dim · b`` bytes each
way per all-to-all, plus ``(ep−1)`` message latencies. Routing is not uniform: the plan assumes the
busiest rank receives :data:`EP_IMBALANCE` × the mean (an assumption, not a measurement: the MoE
debug model's per-step max/mean over 8 single experts was 1.4–2.0 early in training, and a rank's
group of experts averages some of that out; ``report.md``'s Experts section shows a run's figure),
so its all-to-alls and its expert matmuls take that much longer, and the others wait for it. Nothing
overlaps the exchange (the expert computation needs its rows).

Memory: each rank holds ``n_experts / ep`` experts whole (not FSDP-sharded); the dense parameters
stay sharded over dp_shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from accelrun.plan.workload import Gemm, Shape

if TYPE_CHECKING:
    from accelrun.plan.cluster import Cluster
    from accelrun.plan.workload import Workload

EP_IMBALANCE = 1.25  # assumed busiest-rank / mean routed rows under expert parallelism


@dataclass(frozen=True)
class MoEShape(Shape):
    n_experts: int = 8
    experts_per_token: int = 2
    moe_ffn_dim: int = 256
    shared_ffn_dim: int = 0

    @property
    def expert_params(self) -> int:
        """One layer's routed experts' weights (all of them)."""
        return self.n_experts * 3 * self.dim * self.moe_ffn_dim

    def block_gemms(self) -> tuple[Gemm, ...]:
        # ffn_dim is the active width (k experts + the shared one): Llama's seven, then the router.
        return (*super().block_gemms(), Gemm("router", self.dim, self.n_experts, "col"))

    def weight_gemms(self) -> tuple[Gemm, ...]:
        dense = [g for g in self.block_gemms() if g.name not in ("w1", "w3", "w2")]
        experts = [Gemm(f"experts.{n}", self.dim, self.n_experts * self.moe_ffn_dim, "col") for n in ("w1", "w3")]
        experts.append(Gemm("experts.w2", self.n_experts * self.moe_ffn_dim, self.dim, "row"))
        shared = [] if not self.shared_ffn_dim else [
            Gemm("shared.w1", self.dim, self.shared_ffn_dim, "col"), Gemm("shared.w3", self.dim, self.shared_ffn_dim, "col"),
            Gemm("shared.w2", self.shared_ffn_dim, self.dim, "row")]
        return (*dense, *experts, *shared)

    def active_param_count(self, embeddings: bool = True) -> int:
        """Parameters one token uses: its top-k experts (and the shared one and the router), not all of
        them; FLOPs per token count these (``Shape.model_flops_per_token``), so MFU is on active parameters."""
        active_block = sum(g.in_dim * g.out_dim for g in self.block_gemms()) + self.block_vectors
        n = self.n_layers * active_block + self.dim  # + final norm
        if embeddings:
            n += self.embedding_params + self.output_params
        return n


def ep_of(w: Workload) -> int:
    return w.layout.ep if isinstance(w.shape, MoEShape) else 1


def all_to_all_s(w: Workload, cluster: Cluster) -> float:
    """One all-to-all of a layer's routed rows on the busiest rank (0 without expert parallelism)."""
    from accelrun.plan.comm import group_link

    ep, sh = ep_of(w), w.shape
    if ep <= 1:
        return 0.0
    link = group_link(w.layout, cluster, "dp_shard")
    bw, hop = link.cost("all_to_all")
    sent = (ep - 1) / ep * w.chunk_tokens * sh.experts_per_token * sh.dim * w.stream_bytes
    return EP_IMBALANCE * sent / bw + (ep - 1) * hop


def expert_parallel_s(w: Workload, cluster: Cluster, expert_matmul_s: float, layers: int, recomputed: int) -> float:
    """Per chunk on the busiest rank: its all-to-alls (2 forward, 2 backward, 2 more per recomputed
    layer) and the extra expert matmul time its imbalance costs (``expert_matmul_s``: one layer's
    routed-expert matmuls, forward + backward, at the mean load)."""
    if ep_of(w) <= 1:
        return 0.0
    exchanges = 4 * layers + 2 * recomputed
    return exchanges * all_to_all_s(w, cluster) + (EP_IMBALANCE - 1) * expert_matmul_s * layers


def held_params(w: Workload, stage_params: float, shard: int) -> float:
    """Parameters one rank holds of a stage's ``stage_params``: an FSDP shard (1/``shard``) of them,
    except that under expert parallelism the routed experts are ``n_experts / ep`` whole ones."""
    held = stage_params / shard
    if ep_of(w) > 1:
        experts = w.layers_per_stage * w.shape.expert_params
        held += experts / ep_of(w) - experts / shard
    return held


def routed_share(sh: Shape) -> float:
    """The routed experts' share of the block's active feed-forward width."""
    if not isinstance(sh, MoEShape):
        return 0.0
    return sh.experts_per_token * sh.moe_ffn_dim / max(1, sh.ffn_dim)

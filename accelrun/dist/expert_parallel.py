"""Expert parallelism (``parallel.ep``): each MoE layer's experts spread over ``ep`` ranks, tokens sent
to the rank holding their expert and back by all-to-all with uneven splits.

The ep ranks are carved out of the data-parallel shard ranks (dp_shard, × cp where that exists),
not a mesh dimension of their own: with dp_shard = 4 and ep = 2, ranks {0, 1} and {2, 3} each
spread the experts over themselves, and ranks 0 and 2 (1 and 3) hold the same experts. Each rank
holds ``n_experts / ep`` experts whole, as DTensors sharded along the expert dimension over the ep
group (so the checkpoint, the initial values and the gradient norm see the whole tensors), which
FSDP leaves alone (``expert_parallel_params``); the dense parts are FSDP-sharded over dp_shard as
in any run.

One layer's forward on a rank (its kept assignments sorted by expert, so by destination):

1. all-to-all of the per-expert counts (equal splits: ``n_experts / ep`` counts for each rank);
2. all-to-all of the token rows, split by destination rank (uneven), each rank receiving rows
   from every source, each source's block sorted by local expert;
3. rows regrouped by local expert, the local experts' grouped SwiGLU, the inverse regrouping;
4. all-to-all of the outputs back (the splits of step 2 swapped).

Backward is the same exchange reversed (:class:`AllToAll`). Gradients: an expert's weights get, on
the rank that holds them, the gradient of every ep rank's loss (the all-to-all's backward brings it).
The job's loss is the mean of the data-parallel ranks' losses, so :meth:`ExpertParallel.reduce_gradients`
sums the gradients over the ranks holding the same experts (if any) and divides by the
data-parallel degree, which is what FSDP's averaging does for the dense parts.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from accelrun.models.families.moe.experts import grouped_swiglu

# How many all-to-alls each kind of exchange has run in this process (tests assert the path ran).
EXCHANGES: Counter[str] = Counter()


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` sent to the group's ranks in blocks of ``send_splits`` rows; returns the
    ``recv_splits`` blocks received, in rank order. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        EXCHANGES["tokens"] += 1
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send_splits, recv_splits = ctx.splits
        back = grad.new_empty(sum(send_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        EXCHANGES["gradients"] += 1
        return back, None, None, None


class ExpertDispatcher:
    """``Experts.dispatcher`` under expert parallelism: (rows sorted by expert, kept rows per expert,
    w1, w3, w2) → each row's expert output, computed on the rank that holds its expert."""

    def __init__(self, group, ep_size: int, n_experts: int) -> None:
        self.group, self.ep, self.n_experts = group, ep_size, n_experts
        self.local = n_experts // ep_size

    # Runs eagerly under torch.compile: the exchange's splits are read on the host, which Dynamo
    # would break the graph on anyway (once per read, with recompilations on the counters); one clean
    # break per layer instead, and the rest of the block still compiles.
    @torch.compiler.disable(reason="accelrun: expert parallelism's all-to-all runs eagerly there (its splits "
                                   "are read on the host); the code before and after it is compiled")
    def __call__(self, x_AD: torch.Tensor, counts_X: torch.Tensor, w1, w3, w2) -> torch.Tensor:
        ep, local = self.ep, self.local
        counts_X = counts_X.contiguous()
        recv_counts = torch.empty_like(counts_X)  # [source rank, local expert]: rows coming here
        dist.all_to_all_single(recv_counts, counts_X, group=self.group)
        EXCHANGES["counts"] += 1
        sent_RL = counts_X.view(ep, local)
        recv_RL = recv_counts.view(ep, local)
        # The splits are read on the host (all_to_all_single takes Python lists).
        send_splits = sent_RL.sum(1).tolist()
        recv_splits = recv_RL.sum(1).tolist()
        kept = sum(send_splits)
        x_KD = AllToAll.apply(x_AD[:kept], send_splits, recv_splits, self.group)
        # Received rows come per source rank, each block sorted by local expert: regroup by expert.
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=x_KD.device).repeat(ep),
                                                recv_RL.reshape(-1), output_size=x_KD.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)
        y_sorted = grouped_swiglu(x_KD[by_expert], recv_RL.sum(0), _local(w1), _local(w3), _local(w2))
        y_KD = torch.empty_like(y_sorted).index_copy(0, by_expert, y_sorted)
        y_back = AllToAll.apply(y_KD, recv_splits, send_splits, self.group)
        return torch.cat((y_back, y_back.new_zeros(x_AD.shape[0] - kept, y_back.shape[1])))


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def build_ep_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """A 2-D mesh ("ep_replica", "ep") over the job's ranks: "ep" groups are ``ep`` consecutive ranks
    of the dp_shard (× cp) dimension; "ep_replica" links the ranks that hold the same experts."""
    names = list(mesh.mesh_dim_names)
    carved = [n for n in ("dp_shard", "cp") if n in names]
    order = [n for n in names if n not in carved] + carved
    ranks = mesh.mesh.permute([names.index(n) for n in order]).reshape(-1, ep)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("ep_replica", "ep"))


class ExpertParallel:
    """What ``apply_expert_parallel`` did to a model, for the loop to finish each step's gradients."""

    def __init__(self, ep_mesh: DeviceMesh, dp_size: int, params: list[nn.Parameter], local_experts: int) -> None:
        self.ep_mesh, self.dp_size, self.params = ep_mesh, dp_size, params
        self.local_experts = local_experts
        self._exchanges_before = sum(EXCHANGES.values())

    def step_metrics(self) -> dict[str, int]:
        """All-to-alls this rank ran since the last call (counts, tokens, gradients) and the experts
        per layer it holds."""
        now = sum(EXCHANGES.values())
        done, self._exchanges_before = now - self._exchanges_before, now
        return {"ep_all_to_all": done, "ep_local_experts": self.local_experts}

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum each expert's gradient over the ranks holding it, then average over data parallel."""
        replicas = self.ep_mesh["ep_replica"]
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        if replicas.size() > 1:
            for g in grads:  # a few tensors per layer: one collective each is cheap enough
                dist.all_reduce(g, group=replicas.get_group())
        if grads:
            torch._foreach_div_(grads, float(self.dp_size))


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, ep: int, dp_size: int) -> ExpertParallel:
    """Give each ep rank its ``n_experts / ep`` experts of every MoE layer (on the meta device, before
    FSDP and materialisation) and route the layers' tokens through the all-to-all dispatcher."""
    from accelrun.models.families.moe.model import Experts

    ep_mesh = build_ep_mesh(mesh, ep)
    ep_sub = ep_mesh["ep"]
    params: list[nn.Parameter] = []
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        for name in ("w1", "w3", "w2"):
            whole = getattr(module, name)
            local = torch.empty((whole.shape[0] // ep, *whole.shape[1:]), dtype=whole.dtype, device=whole.device)
            sharded = nn.Parameter(DTensor.from_local(local, ep_sub, [Shard(0)], run_check=False,
                                                      shape=whole.shape, stride=whole.stride()))
            sharded._accelrun_expert_parallel = True
            setattr(module, name, sharded)
            params.append(sharded)
        module.dispatcher = ExpertDispatcher(ep_sub.get_group(), ep, module.n_experts)
    local = next((m.n_experts // ep for m in model.modules() if isinstance(m, Experts)), 0)
    return ExpertParallel(ep_mesh, dp_size, params, local)


def expert_parallel_params(model: nn.Module) -> set[nn.Parameter]:
    """The parameters expert parallelism placed (FSDP must leave them alone)."""
    return {p for p in model.parameters() if getattr(p, "_accelrun_expert_parallel", False)}

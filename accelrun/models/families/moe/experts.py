"""Routing and expert computation for the MoE family: no Python loop over tokens or sequences.

``route`` turns router logits into a :class:`Routing`: every (token, choice) *assignment* sorted by
expert, the ones kept under capacity first, dropped ones at the end. ``expert_forward`` gathers the
tokens in that order, runs all experts as grouped matmuls (``grouped_swiglu``: one
``torch._grouped_mm`` per weight, row block e times expert e's matrix; or, on the CPU, each expert's
rows through its own products) and scatters the gated outputs back to their
tokens. Routing keeps shapes static (A = N·K rows whatever the routing); expert parallelism reads
the counts on the host for its all-to-all splits.

``torch._grouped_mm`` runs on the CPU in torch 2.13, but its autograd formula does not (it raises
on the CPU's strides), so :class:`GroupedMatmul` supplies the backward with two more grouped
matmuls: dX = dY · Wᵀ per group and dW_e = X_eᵀ · dY_e (the "K-grouped" form).

``reference_moe`` is a deliberately naive version (a loop over sequences and experts) for tests and
``bench/moe_experts.py`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from accelrun.torch_private import grouped_mm, traces_host_reads


@dataclass
class Routing:
    """One layer's routing of N tokens (B sequences of T) with K choices each: A = N·K assignments."""

    token_A: torch.Tensor  # token of each assignment, in compute order (kept, grouped by expert; dropped last)
    gate_A: torch.Tensor  # its gate weight (fp32), 0 where dropped
    keep_A: torch.Tensor  # bool
    counts_X: torch.Tensor  # kept assignments per expert (int64); they occupy the first sum(counts) rows
    tokens_per_expert: torch.Tensor  # all assignments per expert, before dropping (router load)
    dropped: torch.Tensor  # number of dropped assignments (0-dim)
    aux_loss: torch.Tensor  # load-balancing loss (0-dim, differentiable through the router)


def route(logits_NX: torch.Tensor, B: int, T: int, k: int, capacity: int | None) -> Routing:
    """Top-k token-choice routing with per-sequence capacity (see ``accelrun.models.families.moe.model``)."""
    N, X = logits_NX.shape
    probs_NX = logits_NX.float().softmax(-1)
    top_p_NK, top_x_NK = probs_NX.topk(k, dim=-1)
    gates_NK = top_p_NK / top_p_NK.sum(-1, keepdim=True)

    # Load balance per sequence: f = share of the sequence's assignments, P = mean probability.
    counts_BX = torch.zeros(B, X, device=logits_NX.device).scatter_add_(
        1, top_x_NK.view(B, T * k), torch.ones(B, T * k, device=logits_NX.device))
    f_BX = counts_BX / (T * k)
    p_BX = probs_NX.view(B, T, X).mean(1)
    aux = (X * (f_BX * p_BX).sum(-1)).mean()

    A = N * k
    expert_A = top_x_NK.reshape(A)  # token-major: (token 0, choice 0), (token 0, choice 1), ...
    by_expert_A = torch.argsort(expert_A, stable=True)  # within an expert: earlier tokens first
    sorted_x_A = expert_A[by_expert_A]
    counts_X = counts_BX.sum(0).long()
    if capacity is None:
        keep_sorted_A = torch.ones(A, dtype=torch.bool, device=logits_NX.device)
        order_A = by_expert_A
    else:
        # Rank of an assignment among its (sequence, expert) group = its place in the expert's run
        # minus the assignments of earlier sequences to that expert.
        arange_A = torch.arange(A, device=logits_NX.device)
        start_X = counts_X.cumsum(0) - counts_X
        earlier_BX = (counts_BX.cumsum(0) - counts_BX).long()
        seq_A = by_expert_A // (T * k)
        rank_A = arange_A - start_X[sorted_x_A] - earlier_BX[seq_A, sorted_x_A]
        keep_sorted_A = rank_A < capacity
        # Kept assignments grouped by expert first, dropped ones behind them (key X sorts last).
        key_A = torch.where(keep_sorted_A, sorted_x_A, torch.full_like(sorted_x_A, X))
        regroup_A = torch.argsort(key_A, stable=True)
        order_A = by_expert_A[regroup_A]
        keep_sorted_A = keep_sorted_A[regroup_A]
    kept_X = torch.zeros(X + 1, dtype=torch.long, device=logits_NX.device).index_add_(
        0, torch.where(keep_sorted_A, expert_A[order_A], X), torch.ones_like(order_A))[:X]
    gate_A = gates_NK.reshape(A)[order_A] * keep_sorted_A
    return Routing(token_A=order_A // k, gate_A=gate_A, keep_A=keep_sorted_A, counts_X=kept_X,
                   tokens_per_expert=counts_X, dropped=A - kept_X.sum(), aux_loss=aux)


class GroupedMatmul(torch.autograd.Function):
    """(M, I) rows grouped by ``offsets`` (cumulative ends) times per-group (G, I, O) weights → (M, O).
    Rows past the last offset (dropped assignments) come out as zeros and get zero gradient."""

    @staticmethod
    def forward(ctx, x_MI: torch.Tensor, w_GIO: torch.Tensor, offsets_G: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MI, w_GIO, offsets_G)
        return _rows_in_groups(grouped_mm(x_MI, w_GIO, offs=offsets_G), offsets_G)

    @staticmethod
    def backward(ctx, dy_MO: torch.Tensor):
        x_MI, w_GIO, offsets_G = ctx.saved_tensors
        dy_MO = _rows_in_groups(dy_MO.contiguous(), offsets_G)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _rows_in_groups(grouped_mm(dy_MO, w_GIO.transpose(-2, -1), offs=offsets_G), offsets_G)
        if ctx.needs_input_grad[1]:
            dw = grouped_mm(x_MI.t(), dy_MO, offs=offsets_G)
        return dx, dw, None


def _rows_in_groups(y_MO: torch.Tensor, offsets_G: torch.Tensor) -> torch.Tensor:
    # _grouped_mm leaves rows past the last group unwritten (uninitialised memory): zero them.
    inside_M = torch.arange(y_MO.shape[0], device=y_MO.device) < offsets_G[-1]
    return torch.where(inside_M[:, None], y_MO, torch.zeros((), dtype=y_MO.dtype, device=y_MO.device))


def grouped_mm_takes(device_type: str, dtype: torch.dtype, dim: int, ffn_dim: int) -> bool:
    """Whether ``torch._grouped_mm`` takes the experts' operands: on CUDA, bf16 with rows of whole
    16-byte steps, as its kernel and its meta function (what Dynamo traces with) require in torch 2.13;
    an fp32 run otherwise failed in Dynamo's trace ("Expected inputs of BF16 type")."""
    return device_type == "cuda" and dtype == torch.bfloat16 and dim % 8 == 0 and ffn_dim % 8 == 0


def grouped_swiglu(x_MD: torch.Tensor, counts_G: torch.Tensor, w1_GDC: torch.Tensor, w3_GDC: torch.Tensor,
                   w2_GCD: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """SwiGLU of each row by its group's expert: rows sorted by group, ``counts_G`` rows per group,
    rows past ``sum(counts_G)`` (dropped) give zeros.

    ``impl``:

    - "grouped_mm" (``torch._grouped_mm``: no padding, no host synchronisation; the CUDA default where
      torch's kernel takes the operands, ``grouped_mm_takes``);
    - "split_mm" (each group's rows, split off by its count, through its own three products: a loop
      over experts, the counts read on the host; the CPU default, where torch's grouped kernel measured
      slower and where Dynamo cannot trace it: its fake kernel takes bf16 only);
    - "padded_bmm" (rows scattered into a zero-padded (G, max count, D) batch, three ``bmm``): as fast
      as split_mm where the experts are evenly loaded, and as slow as the widest expert times their
      number otherwise. A trained router is uneven: 2-3x max over mean in the debug MoE's first steps,
      where one layer's experts took 197 ms against split_mm's 58 (``bench/moe_experts.py --skew``).

    The counts read on the host are a graph break under Dynamo (split_mm's experts then run eagerly), and
    sizes read at run time in a whole-graph trace (accelrun's graph cache, ``compile.fullgraph``).
    """
    dtype = x_MD.dtype
    if torch.is_autocast_enabled(x_MD.device.type):  # bf16-mixed: experts compute like the other matmuls
        dtype = torch.get_autocast_dtype(x_MD.device.type)
        x_MD = x_MD.to(dtype)
    w1, w3, w2 = (w.to(dtype) for w in (w1_GDC, w3_GDC, w2_GCD))
    impl = impl or ("grouped_mm" if grouped_mm_takes(x_MD.device.type, dtype, *w1.shape[1:]) else "split_mm")
    if impl == "grouped_mm":
        offsets_G = counts_G.cumsum(0).to(torch.int32)
        h_MC = F.silu(GroupedMatmul.apply(x_MD, w1, offsets_G)) * GroupedMatmul.apply(x_MD, w3, offsets_G)
        return GroupedMatmul.apply(h_MC, w2, offsets_G)
    if impl == "split_mm":
        return (_split_swiglu if traces_host_reads() else _split_swiglu_at_a_break)(x_MD, counts_G, w1, w3, w2)
    if impl != "padded_bmm":
        raise ValueError(f"grouped_swiglu: impl {impl!r}, expected grouped_mm, split_mm or padded_bmm")
    # The two figures that size the batch are read on the host (a synchronisation on a GPU, a graph
    # break under Dynamo).
    kept, widest = (int(v) for v in torch.stack((counts_G.sum(), counts_G.max())).tolist())
    G = counts_G.shape[0]
    group_K = torch.repeat_interleave(torch.arange(G, device=x_MD.device), counts_G, output_size=kept)
    slot_K = torch.arange(kept, device=x_MD.device) - (counts_G.cumsum(0) - counts_G)[group_K]
    x_GSD = x_MD.new_zeros(G, widest, x_MD.shape[1]).index_put((group_K, slot_K), x_MD[:kept])
    h_GSC = F.silu(torch.bmm(x_GSD, w1)) * torch.bmm(x_GSD, w3)  # padding rows stay exactly 0
    y_KD = torch.bmm(h_GSC, w2)[group_K, slot_K]
    return torch.cat((y_KD, y_KD.new_zeros(x_MD.shape[0] - kept, y_KD.shape[1])))


def _split_swiglu(x_MD: torch.Tensor, counts_G: torch.Tensor, w1_GDC: torch.Tensor, w3_GDC: torch.Tensor,
                  w2_GCD: torch.Tensor) -> torch.Tensor:
    counts = counts_G.tolist()  # on the host: the rows of each expert
    kept = sum(counts)
    torch._check(kept <= x_MD.shape[0])  # traced, the counts are sizes read at run time: the kept rows come first
    pieces = x_MD[:kept].split(counts)
    # unbind, not w[g]: each expert's gradient is then its own (G selects would each add a zeroed (G, D, C))
    outs = [(F.silu(x_SD @ w1) * (x_SD @ w3)) @ w2
            for x_SD, w1, w3, w2 in zip(pieces, w1_GDC.unbind(0), w3_GDC.unbind(0), w2_GCD.unbind(0), strict=True)]
    return torch.cat((*outs, x_MD.new_zeros(x_MD.shape[0] - kept, w2_GCD.shape[-1])))


# Where Dynamo would break the graph at the host read, the experts run eagerly at a break of their own:
# traced after such a break, the counts are constants, and Dynamo compiled the experts again for each new
# set of them (past its recompile limit, eagerly all the same). The report says what the break is (the
# text after "accelrun: "). In a whole-graph trace (the graph cache's, compile.fullgraph) the counts are
# sizes read at run time instead, and one graph serves any counts.
_split_swiglu_at_a_break = torch.compiler.disable(
    _split_swiglu, reason="accelrun: a mixture of experts' experts run eagerly there (each expert's rows are counted "
                          "on the host); the router and the code after them are compiled")


def expert_forward(x_ND: torch.Tensor, routing: Routing, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   dispatcher=None) -> torch.Tensor:
    """Σ over a token's kept choices of gate · expert(token), as an (N, D) tensor."""
    x_AD = x_ND[routing.token_A]
    if dispatcher is None:
        out_AD = grouped_swiglu(x_AD, routing.counts_X, w1, w3, w2)
    else:
        out_AD = dispatcher(x_AD, routing.counts_X, w1, w3, w2)
    weighted_AD = out_AD * routing.gate_A[:, None].to(out_AD.dtype)
    # Under bf16-mixed the experts compute in bf16 and the residual stream stays fp32: summed in its dtype
    # (index_add_ refused the mix, so a bf16-mixed MoE never trained).
    return torch.zeros_like(x_ND).index_add_(0, routing.token_A, weighted_AD.to(x_ND.dtype))


def reference_moe(x_ND: torch.Tensor, logits_NX: torch.Tensor, B: int, T: int, k: int, capacity: int | None,
                  w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layer written the slow obvious way (loops over sequences and experts): for tests and
    the benchmark only. Returns (output (N, D), kept mask (N, K))."""
    X = logits_NX.shape[1]
    probs = logits_NX.float().softmax(-1)
    top_p, top_x = probs.topk(k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True)
    keep = torch.ones_like(top_x, dtype=torch.bool)
    if capacity is not None:
        for b in range(B):
            rows = slice(b * T, (b + 1) * T)
            for e in range(X):
                hits = (top_x[rows] == e).flatten().nonzero().flatten()  # token-major order
                dropped = hits[capacity:]
                keep[rows].view(-1)[dropped] = False
    y = torch.zeros_like(x_ND)
    for e in range(X):
        tok, slot = ((top_x == e) & keep).nonzero(as_tuple=True)
        h = F.silu(x_ND[tok] @ w1[e]) * (x_ND[tok] @ w3[e])
        y = y.index_add(0, tok, (h @ w2[e]) * gates[tok, slot, None])
    return y, keep

"""Context parallelism in the plan: the keys and values each rank gathers, their time and memory.

accelrun's context parallelism (``accelrun.dist.context_parallel``) all-gathers each layer's keys
and values over the ``cp`` ranks before the layer's attention, and its backward reduce-scatters their
gradients. Per layer and micro-batch, with ``B`` sequences, ``T`` tokens, ``G·E`` the key/value width
(per TP rank) and ``b`` bytes per element, the whole sequence's keys and values are ``S = 2·B·T·G·E·b``
bytes: a rank sends its ``S/cp`` and receives the other ``(cp−1)/cp·S``.

Overlap: none. The gather is issued when the layer's keys exist and attention needs its result at
once, so the whole exchange is on the critical path (a ring exchange would overlap all but its first
step with attention on the chunks already held). Memory: the gathered keys and values of every
layer (and, off CPUs, SDPA's float copies of the causal masks) stay alive for its backward
(:func:`held_kv_bytes`) beyond what the rank's own tokens save; everything else a rank saves is ``1/cp`` of one rank's training
(``Workload.chunk_tokens``).
"""

from __future__ import annotations

from accelrun.plan.cluster import Cluster
from accelrun.plan.comm import all_gather_s, group_link, reduce_scatter_s
from accelrun.plan.workload import Workload


def sequence_kv_bytes(w: Workload) -> float:
    """``S``: one layer's keys and values for the micro-batch's whole sequences, on one TP rank."""
    return 2.0 * w.chunk_batch * w.seq_len * w.shape.kv_dim / w.layout.tp * w.compute_bytes


def gathered_kv_bytes(w: Workload) -> float:
    """Per layer: the other ranks' keys and values a rank receives and keeps for backward."""
    cp = w.layout.cp
    return sequence_kv_bytes(w) * (cp - 1) / cp if cp > 1 else 0.0


def held_kv_bytes(w: Workload, on_cpu: bool) -> float:
    """Per layer: what context parallelism adds to the activations kept for backward.

    CPU ranks (``accelrun.dist.blockwise_attention``) keep the other ranks' keys and values with their
    own ``kv_dim`` width. Elsewhere attention is SDPA with a mask: the keys and values repeated to the
    query heads (``q_dim`` wide) and the float copy SDPA makes of each chunk's boolean mask,
    ``c × (j+1)·c`` for chunk j, ``c²·(2·cp+1)`` for a rank's two chunks (4 bytes each)."""
    cp = w.layout.cp
    if cp <= 1:
        return 0.0
    width = w.shape.kv_dim if on_cpu else w.shape.q_dim
    kv = 2.0 * w.chunk_batch * w.seq_len * width / w.layout.tp * w.compute_bytes * (cp - 1) / cp
    if on_cpu:
        return kv
    c = w.seq_len // (2 * cp)
    return kv + 4.0 * c * c * (2 * cp + 1)


def cp_gather_s(w: Workload, cluster: Cluster) -> float:
    """One layer's forward all-gather of keys and values."""
    link = group_link(w.layout, cluster, "cp")
    return all_gather_s(sequence_kv_bytes(w), w.layout.cp, link) if link else 0.0


def cp_reduce_s(w: Workload, cluster: Cluster) -> float:
    """One layer's backward reduce-scatter of the key/value gradients."""
    link = group_link(w.layout, cluster, "cp")
    return reduce_scatter_s(sequence_kv_bytes(w), w.layout.cp, link) if link else 0.0


"""Memory traffic of everything that is not a matmul or attention, per token: bytes read + written.

Eager figures are counted, not guessed: every aten op that ``accelrun.models.families.llama.model`` dispatches
outside matmuls and attention (norms, rotary embeddings, key/value repetition, SwiGLU's pointwise
ops, residual adds, casts, the loss), summing the sizes of the tensors it reads and writes that grow
with the number of tokens. ``tests/plan/test_plan_traffic.py`` counts them again on the real model
with a ``TorchDispatchMode`` and must agree exactly.

Compiled figures are a model of fusion, not a count (inductor's kernels are not aten ops): each fused
region reads its inputs and writes its outputs once. Per block, forward: two norms (read the stream,
write the normalised input of the matmuls), rotary embeddings of q and k, key/value repetition under
grouped-query attention, SwiGLU (read gate and up, write their product), two residual adds; backward:
the same regions with gradients (norm backward reads the sum of its consumers' input gradients).

Coefficients multiply D (model dim), Q (the attention's width, n_heads x head_dim: D for Llama, not
for every family), Dkv (key/value width), F (feed-forward dim); ``gqa`` terms apply when there are fewer
key/value heads than query heads (accelrun repeats keys and values to all heads, Q wide). Which of the
attention's bytes are Q wide was counted on a Gemma block whose attention is twice its model's width.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelrun.plan.workload import Workload


@dataclass(frozen=True)
class Part:
    d: float = 0.0
    dkv: float = 0.0
    f: float = 0.0
    const: float = 0.0
    gqa_q: float = 0.0  # extra per Q when keys/values are repeated (to all heads: Q wide)
    q: float = 0.0

    def bytes(self, d: int, dkv: int, f: int, gqa: bool, q: int | None = None) -> float:
        q = d if q is None else q
        return (self.d * d + self.q * q + self.dkv * dkv + self.f * f + self.const
                + (self.gqa_q * q if gqa else 0.0))


# mode → part → (forward, backward). "norm" is one RMSNorm (a block has two); "rest" is the residual
# adds and the accumulation of gradients that reach a tensor by two paths.
EAGER = {
    "fp32": {
        "norm": (Part(d=28, const=24), Part(d=96, const=36)),
        "attention": (Part(q=36, dkv=36, gqa_q=16), Part(d=24, q=24, dkv=56, gqa_q=24)),
        "ffn": (Part(f=20), Part(d=12, f=36)),
        "rest": (Part(d=24), Part(d=24)),
    },
    "autocast": {
        "norm": (Part(d=28, const=24), Part(d=96, const=36)),
        "attention": (Part(d=6, q=48, dkv=48, gqa_q=8), Part(d=18, q=44, dkv=60, gqa_q=12)),
        "ffn": (Part(d=6, f=10), Part(d=12, f=18)),
        "rest": (Part(d=38), Part(d=72)),
    },
    "bf16-params": {
        "norm": (Part(d=36, const=24), Part(d=96, const=36)),
        "attention": (Part(q=48, dkv=48, gqa_q=8), Part(d=12, q=44, dkv=60, gqa_q=12)),
        "ffn": (Part(f=10), Part(d=6, f=18)),
        "rest": (Part(d=12), Part(d=12)),
    },
}
# The head (embedding lookup, final norm, fp32 logits, cross-entropy), per token; V = vocabulary.
EAGER_HEAD = {  # mode → ((cD, cV, const) forward, (cD, cV, const) backward)
    "fp32": ((32, 12, 40), (100, 20, 52)),
    "autocast": ((38, 18, 40), (106, 26, 52)),
    "bf16-params": ((38, 18, 40), (98, 26, 52)),
}

# Optimizer bytes per parameter: fused AdamW reads p, g, m, v and writes p, m, v (7 × 4); foreach
# runs about eight passes (lerp, mul, addcmul, sqrt, div, add, addcdiv, decay), each reading and
# writing fp32 lists (84); gradient clipping reads every gradient for the norm and scales it (12).
OPTIMIZER_BYTES_PER_PARAM = {"fused": 28, "foreach": 84, "for_loop": 84}
CLIP_BYTES_PER_PARAM = 12
# autocast without FSDP casts every weight to bf16 once per micro-batch (read 4, write 2) and
# accumulates the bf16 weight gradient into the fp32 one (read 2, write 4).
AUTOCAST_CAST_BYTES_PER_PARAM = 12


def _fused(s: int, st: int) -> dict[str, tuple[Part, Part]]:
    """The fusion model (module docstring) for compute-dtype bytes ``s`` and stream bytes ``st``."""
    return {
        "norm": (Part(d=st + s, const=4), Part(d=s + 2 * st + 1.5 * s)),
        "attention": (Part(q=2 * s, dkv=2 * s, gqa_q=2 * s), Part(q=2 * s, dkv=2 * s, gqa_q=4 * s)),
        "ffn": (Part(f=3 * s), Part(f=5 * s)),
        "rest": (Part(d=2 * (2 * st + s)), Part(d=6 * st)),
    }


@dataclass(frozen=True)
class BlockTraffic:
    """Bytes per token of one block: forward and backward, replicated and split by TP."""

    forward: float
    backward: float

    def total(self, recompute: bool) -> float:
        return self.forward * (2 if recompute else 1) + self.backward


def block_traffic(w: Workload) -> BlockTraffic:
    """Per-token bytes on one TP rank of one block (norms and residual adds are replicated, or split
    along the sequence under sequence parallelism)."""
    sh, tp = w.shape, w.layout.tp
    split = ("attention", "ffn", "norm", "rest") if w.layout.sequence_parallel else ("attention", "ffn")
    parts = _fused(w.compute_bytes, w.stream_bytes) if w.compiled else EAGER[w.mode]
    out = []
    for phase in (0, 1):
        total = 0.0
        for name, pair in parts.items():
            b = pair[phase].bytes(sh.dim, sh.kv_dim, sh.ffn_dim, sh.gqa, sh.q_dim)
            if name == "norm":
                b *= 2
            total += b / tp if name in split else b
        out.append(total)
    return BlockTraffic(out[0], out[1])


def head_traffic(w: Workload) -> float:
    """Per-token bytes of the head, forward + backward. Plain TP keeps full logits on every rank; loss
    parallelism a ``1/tp`` slice; sequence parallelism splits the embedding's output and the final norm."""
    sh, lay = w.shape, w.layout
    (fd, fv, fc), (bd, bv, bc) = EAGER_HEAD[w.mode]
    d_split = lay.tp if lay.sequence_parallel else 1
    v_split = lay.tp if lay.loss_parallel else 1
    return ((fd + bd) * sh.dim + fc + bc) / d_split + (fv + bv) * sh.vocab_size / v_split

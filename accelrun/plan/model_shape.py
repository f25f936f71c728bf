"""A model's shape as the planner counts it: its matrix multiplies (:class:`Gemm`) and the sizes that give
parameters, FLOPs and bytes (:class:`Shape`). Torch-free; each family's ``shape`` module makes one from a
recipe's ``model`` section. ``accelrun.plan.workload`` (the whole step) and ``accelrun.plan.stage_split``
(the pipeline's split) both read it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Gemm:
    """One weight matrix used once per token: ``in_dim → out_dim``; ``split`` is its TP sharding."""

    name: str
    in_dim: int
    out_dim: int
    split: str  # "col" (out_dim sharded), "row" (in_dim sharded)

    def local(self, tp: int) -> tuple[int, int]:
        return (self.in_dim, self.out_dim // tp) if self.split == "col" else (self.in_dim // tp, self.out_dim)


@dataclass(frozen=True)
class Shape:
    """A decoder's shape as the planner counts it: pre-norm blocks of grouped-query attention and a
    gated feed-forward (three matrices), two norms each; embedding, final norm, output layer. The
    memory and traffic coefficients (``activations``, ``traffic``) were counted on Llama's block;
    ``family`` says whose shape this is."""

    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool
    explicit_head_dim: int | None = None  # None = dim / n_heads (Gemma sets its own)
    family: str = "llama"
    # Qwen2's q, k, v biases. The planner leaves them out (negligible: plan/coverage.py); a family's
    # own counts (its ``shape`` module's ``param_count`` and ``flops_per_token``) set it.
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the attention's queries (and of its output before the output projection)."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def gqa(self) -> bool:
        return self.kv_heads < self.n_heads

    def block_gemms(self) -> tuple[Gemm, ...]:
        d, q, kv, f = self.dim, self.q_dim, self.kv_dim, self.ffn_dim
        # Forward order; selective checkpointing counts these (torchtitan's "every second mm").
        return (Gemm("wq", d, q, "col"), Gemm("wk", d, kv, "col"), Gemm("wv", d, kv, "col"),
                Gemm("wo", q, d, "row"), Gemm("w1", d, f, "col"), Gemm("w3", d, f, "col"),
                Gemm("w2", f, d, "row"))

    def block_gemms_merged(self) -> tuple[Gemm, ...]:
        """``block_gemms`` as accelrun's ``merge_parallel_linears`` pass leaves them: a run of column-parallel
        matrices that read the same input becomes one, when one of them is narrower than that input
        (q, k and v under grouped-query attention; never SwiGLU's w1 and w3, which widen)."""
        out: list[Gemm] = []
        for (column, _), run in itertools.groupby(self.block_gemms(), key=lambda g: (g.split == "col", g.in_dim)):
            run = list(run)
            if column and len(run) > 1 and any(g.out_dim < g.in_dim for g in run):
                out.append(Gemm("+".join(g.name for g in run), run[0].in_dim, sum(g.out_dim for g in run), "col"))
            else:
                out.extend(run)
        return tuple(out)

    def output_gemm(self) -> Gemm:
        return Gemm("output", self.dim, self.vocab_size, "col")

    @property
    def block_params(self) -> int:
        return sum(g.in_dim * g.out_dim for g in self.weight_gemms()) + self.block_vectors

    @property
    def block_vectors(self) -> int:
        """A block's parameters outside its matrices: two norm gains, and the q, k, v biases if any."""
        biases = (self.n_heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return 2 * self.dim + biases

    def weight_gemms(self) -> tuple[Gemm, ...]:
        """The block's weight matrices as stored (memory); ``block_gemms`` are those one token
        multiplies (time). The same for a dense block; a mixture of experts stores every expert
        (``accelrun.plan.moe``)."""
        return self.block_gemms()

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def output_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab_size * self.dim

    def param_count(self, embeddings: bool = True) -> int:
        """Distinct parameters (``embeddings=False``: without the vocabulary-sized matrices)."""
        n = self.n_layers * self.block_params + self.dim  # + final norm
        if embeddings:
            n += self.embedding_params + self.output_params
        return n

    def active_param_count(self, embeddings: bool = True) -> int:
        """Parameters one token multiplies: all of them in a dense model (``MoEShape``: its top-k experts)."""
        return self.param_count(embeddings)

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token by the MFU convention: the one formula every family's FLOPs use.

        The PaLM / Chinchilla convention, which most tools use for MFU, so figures compare: a matmul of
        (m, k) by (k, n) costs 2·m·k·n; backward costs twice the forward. Every weight a token
        multiplies counts 2 FLOPs forward (the embedding is a lookup, not counted; the output
        projection is, even when tied); attention scores and values cost 2·T·(n_heads·head_dim) each
        per token and layer, the causal half **not** subtracted. Norms, activations, softmax, rotary
        embeddings and routing are not counted. So, per token:

            training = 3 · (2·(N_active_non_embedding + V·D) + 4·L·T·(n_heads·head_dim))
        """
        matmul_weights = self.active_param_count(embeddings=False) + self.vocab_size * self.dim
        attention = 4 * self.n_layers * seq_len * self.q_dim
        return 3.0 * (2 * matmul_weights + attention)

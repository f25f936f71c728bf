"""Which layers each pipeline stage runs when the recipe does not say (``parallel.pp_layers``).

A stage's cost is counted in blocks ("layer equivalents"). The first stage also holds the embedding and
the last the final norm, the output layer and the loss, so an even split of the blocks loads the ends
more than the stages between them; with Llama 3's 128K vocabulary each end is worth about two thirds
of a 405B block. Meta's 405B run took one block off the first and the last stage for that reason (The
Llama 3 Herd of Models, 2024, section 3.3.2: the first stage is memory-bound by the embedding and the
warm-up micro-batches, the last compute-bound by the output layer and loss), and torchtitan's default
split gives its ends one block fewer than the stages between them.

An end's cost is the larger of its two shares of a block's:

- parameters, which set what the stage keeps in memory (weights, gradients, optimizer state, FSDP's
  gathered copies under pipelining: ``accelrun.plan.memory`` charges all of them per parameter);
- training FLOPs, which set the stage's time (``accelrun.plan.timing``'s terms: matmuls forward and
  backward, attention as the fused kernel executes it, the forward again under full checkpointing).
  The embedding is a lookup (no FLOPs); the output layer is a matmul as wide as the vocabulary.

Costs are rounded to whole blocks before splitting, so a model whose ends are cheap (less than half a
block each, as for every small vocabulary) gets exactly the layer-balanced split accelrun has always
made, the first stages taking the remainder. ``split_layers`` then adds blocks one at a time to the
cheapest stage (the earliest of equals): that minimises the most loaded stage and leaves every stage
within one block of the others, except an end that costs more than its share on its own (it keeps one
block). Torch-free: ``accelrun plan`` and ``accelrun.dist.pipeline`` make the same split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from accelrun.plan.efficiency import ATTENTION_BACKWARD_RATIO
from accelrun.plan.model_shape import Shape


@dataclass(frozen=True)
class EndCosts:
    """What the first and the last stage run besides their blocks, in blocks (fractions allowed)."""

    first: float = 0.0  # the embedding
    last: float = 0.0  # final norm, output layer and loss

    def whole(self) -> tuple[int, int]:
        """Rounded to whole blocks (half up): what the split moves."""
        return math.floor(self.first + 0.5), math.floor(self.last + 0.5)


def block_train_flops(shape: Shape, seq_len: int, recompute: bool) -> float:
    """FLOPs one token costs a block in one training step, as the planner times it: each matmul forward
    and twice backward, causal attention (half the scores) forward and ``ATTENTION_BACKWARD_RATIO``
    times that backward; ``recompute``: the forward again (full activation checkpointing)."""
    matmul = 2.0 * sum(g.in_dim * g.out_dim for g in shape.block_gemms())
    attention = 2.0 * seq_len * shape.q_dim
    return 3 * matmul + (1 + ATTENTION_BACKWARD_RATIO) * attention + ((matmul + attention) if recompute else 0.0)


def end_costs(shape: Shape, seq_len: int, recompute: bool = False, pipelined: bool = True) -> EndCosts:
    """The ends' costs in blocks (module docstring). ``pipelined``: a tied output layer on a last stage
    that is not the first needs a copy of its own (``accelrun.plan.memory.stage_params``)."""
    block_params = shape.block_params
    head_params = shape.embedding_params if (shape.tie_embeddings and pipelined) else shape.output_params
    head_flops = 3 * 2.0 * shape.dim * shape.vocab_size  # the output layer; the loss's elementwise work is not FLOPs
    return EndCosts(
        first=shape.embedding_params / block_params,
        last=max(head_params / block_params, head_flops / block_train_flops(shape, seq_len, recompute)),
    )


def split_layers(n_layers: int, n_stages: int, ends: EndCosts = EndCosts()) -> tuple[int, ...]:
    """Blocks per stage, contiguous in stage order: every stage at least one, the most loaded stage (its
    blocks plus its end's whole-block cost) as light as it can be, ties to the earliest stage.

    >>> split_layers(6, 4)                       # ends cheap: the remainder to the first stages
    (2, 2, 1, 1)
    >>> split_layers(126, 16, EndCosts(0.66, 0.66))   # Llama 3 405B, 16 stages: the ends a block short
    (7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7)
    """
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages of at least one layer")
    first, last = ends.whole()
    extra = [0] * n_stages
    extra[0] += first
    extra[-1] += last
    layers = [1] * n_stages
    # Water-filling: each further block goes to the cheapest stage. Deterministic (no ties left to chance),
    # so every rank computes the same split.
    for _ in range(n_layers - n_stages):
        cheapest = min(range(n_stages), key=lambda s: (layers[s] + extra[s], s))
        layers[cheapest] += 1
    return tuple(layers)


def recipe_end_costs(cfg) -> EndCosts:
    """The ends' costs of a validated recipe's (``RunConfig``) model at its sequence length and
    checkpointing; nothing for a model whose shape is unknown (``model.custom``, a family without a
    ``shape`` module)."""
    if cfg.model.custom is not None:
        return EndCosts()
    from accelrun.errors import UserError
    from accelrun.models.families import plan_shape  # torch-free: the family's shape module

    try:
        shape = plan_shape(cfg.model)
    except UserError:  # a family the planner cannot shape yet: its blocks alone
        return EndCosts()
    return end_costs(shape, cfg.train.seq_len, recompute=cfg.train.activation_checkpoint.mode == "full")


def recipe_stage_layers(cfg) -> tuple[int, ...]:
    """Blocks per pipeline stage of a validated recipe with ``parallel.pp > 1``: ``parallel.pp_layers``
    as written, or ``split_layers`` with the ends of the recipe's model."""
    par = cfg.parallel
    if par.pp_layers is not None:
        return tuple(len(stage) for stage in par.pp_layers)
    return split_layers(cfg.model.n_layers, par.degrees()["pp"] * par.stages_per_rank, recipe_end_costs(cfg))


def layer_ranges(counts: tuple[int, ...]) -> list[range]:
    """Blocks per stage → each stage's layer indices."""
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out

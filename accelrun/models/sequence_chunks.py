"""Which tokens of a sequence each context-parallel rank holds: load-balanced head and tail chunks.

A sequence of ``T`` tokens is cut into ``2 × cp`` chunks of ``c = T / (2 × cp)``; rank ``r`` holds
chunk ``r`` and chunk ``2·cp − 1 − r``, in that order (its local sequence is ``2c`` tokens). Under a
causal mask an early chunk attends to few keys and a late one to many; pairing the ``r``-th from the
front with the ``r``-th from the back gives every rank the same attention work:
``c² · (r + 1) + c² · (2·cp − r) = c² · (2·cp + 1)``.

>>> chunk_ids(0, 2), chunk_ids(1, 2)
((0, 3), (1, 2))
>>> chunk_positions(4, 1, 2).tolist()   # T = 8: rank 1 holds tokens 2, 3 and 4, 5
[2, 3, 4, 5]
"""

from __future__ import annotations

import torch


def chunk_ids(rank: int, size: int) -> tuple[int, int]:
    """The (head, tail) chunk indices rank ``rank`` of ``size`` holds, out of ``2 × size``."""
    return rank, 2 * size - 1 - rank


def chunk_positions(local_len: int, rank: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (int64, ``local_len``) of the tokens rank ``rank`` holds, in its local order."""
    c = local_len // 2
    head, tail = chunk_ids(rank, size)
    return torch.cat([torch.arange(head * c, head * c + c, device=device),
                      torch.arange(tail * c, tail * c + c, device=device)])


def take_local_chunks(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``x`` (the whole sequence along ``dim``), concatenated."""
    chunks = x.chunk(2 * size, dim=dim)
    head, tail = chunk_ids(rank, size)
    return torch.cat([chunks[head], chunks[tail]], dim=dim).contiguous()


def sequence_from_rank_chunks(x_R2: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """The whole sequence from every rank's chunks.

    ``x_R2`` has the ranks along dim 0 and, at ``seq_dim`` (counted in ``x_R2``), two entries per rank
    (head, tail) before the chunk's own positions at ``seq_dim + 1``: shape ``(cp, ..., 2, c, ...)``.
    Returns ``(..., 2·cp·c, ...)``: heads of ranks 0..cp−1, then tails of ranks cp−1..0 (chunks 0..2·cp−1).
    """
    # unbind and one stack: a single copy, and backward views of the gradient (select's backward
    # would allocate a zeroed whole-size gradient per selection).
    d = seq_dim - 1  # the (head, tail) axis once the ranks' axis is unbound
    per_rank = [x.unbind(d) for x in x_R2.unbind(0)]
    chunks = [head for head, _ in per_rank] + [tail for _, tail in reversed(per_rank)]  # chunks 0..2cp-1
    return torch.stack(chunks, dim=d).flatten(d, d + 1)

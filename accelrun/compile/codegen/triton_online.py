"""Which passes of a looped row kernel can share one loop by an online (running-max) sum of exponentials.

Softmax, log-softmax and logsumexp reduce a row twice: ``m = max(x)``, then ``s = sum(exp(x - k))`` with
``k`` a per-row value computed from ``m`` (``m`` itself, or logsumexp's ``m`` with infinities replaced
by 0). A row held in one tile pays nothing for the second pass; a looped row (a vocabulary's, in
``triton.py``) reads the row from memory again. Folded into the max's loop, each lane of the partial
tile keeps its running max ``M`` and ``S = sum(exp(x - sh(M)))`` (``sh``: ``M``, or 0 where ``M`` is
infinite), rescaled by ``exp(sh(M_old) - sh(M_new))`` when its max grows; after the loop,
``s = sum over lanes of S * exp(sh(M) - k)``, for whatever ``k`` the row's ``m`` gives.

``online_pairs`` finds such pairs of inner blocks in the loop IR; ``triton.py`` writes them. A pair
needs: the first block folds ``max`` over a value ``x``; the second block's only values that depend on
anything the first pass produced are ``d = x' - k`` and ``exp(d)``, where ``x'`` is the same expression
as ``x`` (recomputed: same loads and ops) and ``exp(d)`` is what a ``sum`` folds and nothing else reads
(except a row buffer's copy for a later pass, which recomputes it anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from accelrun.compile.codegen.loop_ir import Block, Kernel, Reduction


@dataclass(frozen=True)
class OnlinePair:
    first: int  # index in kernel.blocks of the block with the max
    second: int  # index of the block with the sum of exponentials
    max_red: Reduction
    sum_red: Reduction
    same: str  # the second block's recomputation of the max's value
    shift: str  # k: the per-row value subtracted before the exp
    skipped: frozenset[str]  # the second block's names not computed in the shared loop (d and exp(d))


def online_pairs(kernel: Kernel) -> dict[int, OnlinePair]:
    """The pairs of a kernel's inner blocks that can run as one loop, keyed by the first block's index."""
    rows = {b.name for b in kernel.row_buffers}
    sources = {st.buffer: (b, st.value) for b in kernel.blocks for st in b.stores if st.buffer in rows}
    inner = [i for i, b in enumerate(kernel.blocks) if b.level == "inner"]
    out: dict[int, OnlinePair] = {}
    taken: set[int] = set()
    for i, j in pairwise(inner):
        if i in taken:
            continue
        pair = _match(kernel, i, j, rows, sources)
        if pair is not None:
            out[i] = pair
            taken.add(j)
    return out


def _match(kernel: Kernel, i: int, j: int, rows: set[str],
           sources: dict[str, tuple[Block, str]]) -> OnlinePair | None:  # fmt: skip
    first, second = kernel.blocks[i], kernel.blocks[j]
    late = {r.name for r in first.reductions} | {s.name for b in kernel.blocks[i + 1 : j] for s in b.stmts}
    defs = {s.name: s for s in second.stmts}
    tainted: set[str] = set()
    for s in second.stmts:
        if s.op not in ("load", "const", "index") and any(isinstance(a, str) and (a in late or a in tainted)
                                                          for a in s.args):  # fmt: skip
            tainted.add(s.name)
    for total in second.reductions:
        exp = defs.get(total.value)
        if total.op != "sum" or total.ctype != "f32" or exp is None or exp.op != "exp":
            continue
        diff = defs.get(exp.args[0])
        if diff is None or diff.op != "sub" or diff.ctype != "f32":
            continue
        same, shift = diff.args
        if same not in defs or shift not in late or tainted != {diff.name, exp.name}:
            continue
        if not _only_reader(second, diff.name, exp.name, rows) or not _only_reader(second, exp.name, total, rows):
            continue
        want = _canon(second, same, sources)
        for top in first.reductions:
            if top.op == "max" and top.ctype == "f32" and _canon(first, top.value, sources) == want:
                return OnlinePair(i, j, top, total, same, shift, frozenset({diff.name, exp.name}))
    return None


def _only_reader(block: Block, name: str, reader: str | Reduction, rows: set[str]) -> bool:
    """True when nothing in ``block`` reads ``name`` but ``reader`` (a statement's name or a
    reduction), and row-buffer copies."""
    for s in block.stmts:
        if s.name != reader and s.op not in ("load", "const", "index") and name in s.args:
            return False
    if any(r is not reader and r.value == name for r in block.reductions):
        return False
    return all(st.buffer in rows or st.value != name for st in block.stores)


def _canon(block: Block, name: str, sources: dict[str, tuple[Block, str]]) -> Any:
    """An expression's structure over loads, constants and ops (not its SSA names): equal for a value
    and its recomputation in a later block."""
    stmt = next((s for s in block.stmts if s.name == name), None)
    if stmt is None:
        return ("outer", name)
    if stmt.op == "load" and stmt.args[0] in sources:
        earlier, value = sources[stmt.args[0]]
        return _canon(earlier, value, sources)
    if stmt.op == "load":
        return ("load", stmt.args[0], str(stmt.args[1]), stmt.ctype)
    if stmt.op in ("const", "index"):
        return (stmt.op, str(stmt.args[0]), stmt.ctype)
    return (stmt.op, stmt.ctype, tuple(_canon(block, a, sources) if isinstance(a, str) else a for a in stmt.args))

"""Index simplification: the rewritten expression equals the original at every point checked."""

from __future__ import annotations

import itertools

import sympy
from torch.utils._sympy.functions import FloorDiv

from accelrun.compile.codegen.index_simplify import IndexMod, simplify_index

c, r = sympy.symbols("c r", integer=True, nonnegative=True)

CASES = [
    # a pair-unrolled loop's odd element through a (6, 16, 2) reshape and back: 2*c + 1
    (32 * FloorDiv(1 + 2 * c, 32) + 2 * FloorDiv(sympy.Mod(1 + 2 * c, 32), 2) + 1, {}, 2 * c + 1),
    # (16, 256) rows of a (16, 256, 192) tensor: one stride
    (49152 * FloorDiv(r, 256) + 192 * sympy.Mod(r, 256), {}, 192 * r),
    (32 * FloorDiv(sympy.Mod(c, 64), 32) + sympy.Mod(c, 32), {}, IndexMod(c, 64)),
    # (6, 2, 4) -> (6, 8) of a (1, 0, 2) permute, 4-unrolled, third element: sympy's own Mod would
    # rewrite Mod(2*Mod(2*c + 1, 4), 4) as 2*Mod(2*c + 1, 4) on the way (28 instead of 24 per c % 2)
    (24 * FloorDiv(IndexMod(4 * c + 2, 8), 4) + 4 * FloorDiv(4 * c + 2, 8) + IndexMod(IndexMod(4 * c + 2, 8), 4),
     {c: 12}, 4 * FloorDiv(c, 2) + 24 * IndexMod(c, 2) + 2),
    # with c < 16 (the loop's trip count), c // 16 and c % 16 are 0 and c
    (96 * FloorDiv(c, 16) + 2 * sympy.Mod(c, 16) + 5, {c: 16}, 2 * c + 5),
    # whole multiples of the divisor leave a modulo and come out of a division
    (IndexMod(c + 64 * IndexMod(r, 4), 64), {c: 64}, c),
    (FloorDiv(c + 64 * r + 128, 64), {}, r + 2 + FloorDiv(c, 64)),
    # nothing to do: a real head jump stays
    (96 * FloorDiv(c, 16) + 2 * sympy.Mod(c, 16), {}, None),
    (FloorDiv(3 * c + 1, 2), {}, None),  # 3 is no multiple of 2: left alone
]


def test_simplified_indices_agree_with_the_original_everywhere():
    for expr, bounds, want in CASES:
        got = simplify_index(expr, bounds)
        if want is not None:
            assert sympy.simplify(got - want) == 0, (expr, got)
        top_c = bounds.get(c, 200)
        for cv, rv in itertools.product(range(top_c), (0, 1, 255, 256, 1000)):
            assert got.subs({c: cv, r: rv}) == expr.subs({c: cv, r: rv}), (expr, got, cv, rv)


def test_unknown_bounds_keep_the_division():
    assert simplify_index(FloorDiv(c, 16)) == FloorDiv(c, 16)
    assert simplify_index(FloorDiv(c, 16), {c: 16}) == 0
    assert simplify_index(sympy.Mod(c + 3, 16), {c: 13}) == c + 3
    assert simplify_index(sympy.Mod(c + 3, 16), {c: 14}) != c + 3


def test_index_mod_decides_what_pytorchs_mod_decides():
    """accelrun's IndexMod evaluates from integer coefficients what PyTorch's Mod evaluates through
    sympy's assumptions: the same value where PyTorch's decides one, unevaluated where it does not."""
    from torch.utils._sympy.functions import Mod as TorchMod

    x = sympy.Symbol("x", integer=True, nonnegative=True)
    numerators = [sympy.Integer(n) for n in (0, 1, 7, 64)]
    numerators += [a * c + b * r + k for a in (0, 1, 2, 3, 32) for b in (0, 1, 4) for k in (0, 1, 2, 32)]
    numerators += [2 * FloorDiv(c, 3) + 4, 3 * TorchMod(c, 4) + 6, 2 * c * r + 2]
    decided = 0
    for p, q in itertools.product(numerators, (1, 2, 3, 4, 32)):
        ours, torchs = IndexMod(p, q), TorchMod(p, q)
        assert isinstance(ours, TorchMod) == isinstance(torchs, TorchMod), (p, q, ours, torchs)
        if not isinstance(torchs, TorchMod):
            decided += 1
            assert ours == torchs, (p, q)
        else:
            assert ours.args == torchs.args
    assert decided > 50
    assert isinstance(IndexMod(x / 2, 4), TorchMod)  # not an integer coefficient: PyTorch's eval decides

"""Simplify the index expressions that views compose (nonnegative integer symbols only).

A reshape unravels a flat index into axes and the next view ravels them again, so sympy is left
with ``32*((2*c + 1)//32) + 2*((Mod(2*c + 1, 32))//2)`` where the loop only needs ``2*c``. In a
vector loop each ``//`` and ``%`` of the loop variable is a division per element and turns a
strided load into a gather. Four rules, applied bottom-up until nothing changes:

- ``(a*x + b) // (a*n)  ->  x // n`` and ``(a*x + b) // a  ->  x``            (0 <= b < a)
- ``Mod(a*x + b, a*n)   ->  a*Mod(x, n) + b``                                  (0 <= b < a)
- ``k*m*(x // m) + k*Mod(x, m)  ->  k*x``                                      (the two halves of x)
- ``(x + d*y) // d  ->  x // d + y`` and ``Mod(x + d*y, d)  ->  Mod(x, d)``     (whole multiples of d)

and, with bounds on the symbols, ``x // m -> 0`` and ``Mod(x, m) -> x`` where x < m.

where ``a*x`` is a sum of terms whose integer coefficients are all multiples of ``a``.
"""

from __future__ import annotations

import functools

import sympy

from accelrun.torch_private import FloorDiv
from accelrun.torch_private import IndexMod as TorchMod


class IndexMod(TorchMod):
    """PyTorch's Mod for nonnegative integers, deciding what PyTorch's decides for index expressions
    (a literal, a multiple of the modulus, parity) from the terms' integer coefficients. PyTorch's own
    asks sympy's assumptions about ``p / q`` and ``p < q`` on every construction: 93 ms of the debug
    Llama's 2 s cold step on a 2-core CPU. Anything else (a modulus that is not an integer, a term
    that is not an integer coefficient times an integer) goes to PyTorch's."""

    @classmethod
    def eval(cls, p: sympy.Expr, q: sympy.Expr) -> sympy.Expr | None:
        terms = _integer_terms(p) if q.is_Integer and q > 0 and not (p.is_Integer and p < 0) else None
        if terms is None:
            return super().eval(p, q)
        constant, coefficients = terms
        modulus = int(q)
        if modulus == 1 or all(c % modulus == 0 for c in (constant, *coefficients)):
            return sympy.Integer(0)  # a literal's remainder 0 too, or a multiple of q
        if not coefficients:
            return sympy.Integer(constant % modulus)
        if modulus == 2 and all(c % 2 == 0 for c in coefficients):
            return sympy.Integer(constant % 2)
        return None


def _integer_terms(p: sympy.Expr) -> tuple[int, list[int]] | None:
    """(constant, coefficients of the other terms) of ``p``, a sum of integer coefficients times
    integer-valued factors; None if it is not one."""
    constant, coefficients = 0, []
    for term in sympy.Add.make_args(p):
        coeff, factor = term.as_coeff_Mul()
        if not coeff.is_Integer:
            return None
        if factor == 1:
            constant += int(coeff)
        elif factor.is_integer:
            coefficients.append(int(coeff))
        else:
            return None
    return constant, coefficients


# sympy's own Mod rewrites itself on construction, and not always correctly for nested moduli:
# Mod(2*Mod(2*c + 1, 4), 4) evaluates to 2*Mod(2*c + 1, 4) (6 where 2 is right). Indices are built
# with PyTorch's Mod for nonnegative integers, which evaluates only what it can prove; all are read.
MODS = (sympy.Mod, TorchMod)


def simplify_index(expr: sympy.Expr, bounds: dict[sympy.Symbol, int] | None = None) -> sympy.Expr:
    """``expr`` simplified; ``bounds`` gives symbols' exclusive upper bounds (a loop's trip count),
    which turn ``x // m`` into 0 and ``Mod(x, m)`` into x where x < m."""
    return _simplified(expr, frozenset((bounds or {}).items()))


# A model's forward and backward graphs, and its repeated blocks, ask for the same indices again and
# again; sympy's rewriting was a fifth of a cold compile's lowering (2026-12-02).
@functools.lru_cache(maxsize=4096)
def _simplified(expr: sympy.Expr, bound_items: frozenset[tuple[sympy.Symbol, int]]) -> sympy.Expr:
    bounds = dict(bound_items)
    for _ in range(16):  # each round removes at least one division or modulo; a few suffice
        new = sympy.expand(_rewrite(expr, bounds))
        if new == expr:
            return new
        expr = new
    return expr


def _rewrite(expr: sympy.Expr, bounds: dict[sympy.Symbol, int]) -> sympy.Expr:
    if not expr.args:
        return expr
    args = [_rewrite(a, bounds) for a in expr.args]
    if isinstance(expr, (FloorDiv, *MODS)):
        top = _upper(args[0], bounds)
        if args[1].is_Integer and top is not None and top < int(args[1]):
            return sympy.Integer(0) if isinstance(expr, FloorDiv) else args[0]
        return _floordiv(*args) if isinstance(expr, FloorDiv) else _mod(*args)
    if isinstance(expr, sympy.Add):
        return _join_halves(sympy.Add(*args))
    return expr.func(*args)


def _upper(expr: sympy.Expr, bounds: dict[sympy.Symbol, int]) -> int | None:
    """The largest value ``expr`` can take, or None if unknown (nonnegative terms only)."""
    if expr.is_Integer:
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return bounds[expr] - 1 if expr in bounds else None
    if isinstance(expr, MODS) and expr.args[1].is_Integer:
        return int(expr.args[1]) - 1
    if isinstance(expr, FloorDiv) and expr.args[1].is_Integer:
        top = _upper(expr.args[0], bounds)
        return None if top is None else top // int(expr.args[1])
    if isinstance(expr, sympy.Add):
        tops = [_upper(a, bounds) for a in expr.args]
        return None if None in tops else sum(tops)
    if isinstance(expr, sympy.Mul):
        coeff, rest = expr.as_coeff_Mul()
        top = _upper(rest, bounds)
        return None if top is None or not coeff.is_Integer or coeff < 0 else int(coeff) * top
    return None


def _split(num: sympy.Expr, a: int) -> tuple[sympy.Expr, int] | None:
    """``num`` as ``a*x + b`` with 0 <= b < a (x = the terms divided by a), or None."""
    num = sympy.expand(num)
    const = int(num.as_coeff_Add()[0]) if num.as_coeff_Add()[0].is_Integer else 0
    rest = num - const
    terms = sympy.Add.make_args(rest) if rest != 0 else ()
    if not (0 <= const < a):
        return None
    parts = []
    for t in terms:
        coeff, factor = t.as_coeff_Mul()
        if not coeff.is_Integer or int(coeff) % a:
            return None
        parts.append(sympy.Integer(int(coeff) // a) * factor)
    return sympy.Add(*parts), const


def _factored(num: sympy.Expr, den: sympy.Expr) -> tuple[sympy.Expr, int, int, int] | None:
    """``(x, b, a, d)`` with num = a*x + b, 0 <= b < a, a > 1 dividing the divisor d; None if none."""
    if not (den.is_Integer and int(den) > 1):
        return None
    d = int(den)
    for a in _common_divisors(num, d):
        split = _split(num, a)
        if split is not None:
            return split[0], split[1], a, d
    return None


def _whole_multiples(num: sympy.Expr, den: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """``num`` as ``rest + den*q``, q collecting the terms whose coefficient ``den`` divides."""
    if not (den.is_Integer and int(den) > 1):
        return num, sympy.Integer(0)
    d, rest, q = int(den), [], []
    for t in sympy.Add.make_args(sympy.expand(num)):
        coeff, factor = t.as_coeff_Mul()
        if coeff.is_Integer and int(coeff) % d == 0 and int(coeff) != 0:
            q.append(sympy.Integer(int(coeff) // d) * factor)
        else:
            rest.append(t)
    return sympy.Add(*rest), sympy.Add(*q)


def _floordiv(num: sympy.Expr, den: sympy.Expr) -> sympy.Expr:
    rest, q = _whole_multiples(num, den)
    if q != 0:  # (x + d*y) // d == x // d + y
        return q + (_floordiv(rest, den) if rest != 0 else 0)
    f = _factored(num, den)
    if f is None:
        return FloorDiv(num, den)
    x, _, a, d = f
    return x if a == d else FloorDiv(x, sympy.Integer(d // a))


def _mod(num: sympy.Expr, den: sympy.Expr) -> sympy.Expr:
    rest, q = _whole_multiples(num, den)
    if q != 0:  # (x + d*y) % d == x % d
        return _mod(rest, den) if rest != 0 else sympy.Integer(0)
    f = _factored(num, den)
    if f is None:
        return IndexMod(num, den)
    x, b, a, d = f
    return sympy.Integer(b) if a == d else a * IndexMod(x, sympy.Integer(d // a)) + b


def _common_divisors(num: sympy.Expr, d: int) -> list[int]:
    """Divisors a > 1 of d that divide every variable term's coefficient in num, largest first."""
    g = 0
    for t in sympy.Add.make_args(sympy.expand(num)):
        coeff, factor = t.as_coeff_Mul()
        if factor != 1:
            g = sympy.igcd(g, int(coeff)) if coeff.is_Integer else 1
    g = sympy.igcd(g, d) if g else 0
    return [a for a in range(g, 1, -1) if g % a == 0 and d % a == 0]


def _join_halves(expr: sympy.Expr) -> sympy.Expr:
    """Replace ``k*m*(x//m) + k*Mod(x, m)`` inside a sum by ``k*x``."""
    terms = list(sympy.Add.make_args(expr))
    changed = True
    while changed:
        changed = False
        for i, t in enumerate(terms):
            kq, q = t.as_coeff_Mul()
            if not (isinstance(q, FloorDiv) and q.args[1].is_Integer):
                continue
            x, m = q.args
            for j, u in enumerate(terms):
                kr, r = u.as_coeff_Mul()
                if i != j and _is_mod_of(r, x, m) and kq == kr * m:
                    terms = [v for n, v in enumerate(terms) if n not in (i, j)] + [kr * x]
                    changed = True
                    break
            if changed:
                break
    return sympy.Add(*terms)


def _is_mod_of(r: sympy.Expr, x: sympy.Expr, m: sympy.Expr) -> bool:
    """``r`` is ``Mod(x, m)``, also written ``Mod(y, m)`` when ``x`` is ``Mod(y, n)`` and m divides n."""
    if not isinstance(r, MODS) or r.args[1] != m:
        return False
    if r.args[0] == x:
        return True
    return (isinstance(x, MODS) and x.args[0] == r.args[0] and x.args[1].is_Integer and m.is_Integer
            and int(x.args[1]) % int(m) == 0)  # fmt: skip

"""Printing sympy index expressions as C++ or Triton integer arithmetic (all indices are >= 0)."""

from __future__ import annotations

import sympy

from accelrun.compile.codegen.index_simplify import MODS
from accelrun.torch_private import FloorDiv

# style → (floor division, modulo, min, max)
_STYLES = {
    "cpp": ("({0} / {1})", "({0} % {1})", "acc_min_i64({0}, {1})", "acc_max_i64({0}, {1})"),
    "triton": ("({0} // {1})", "({0} % {1})", "tl.minimum({0}, {1})", "tl.maximum({0}, {1})"),
}


def print_index(expr: sympy.Expr, style: str) -> str:
    div, mod, lo, hi = _STYLES[style]

    def p(e: sympy.Expr) -> str:
        if isinstance(e, sympy.Integer):
            return str(int(e))
        if isinstance(e, sympy.Symbol):
            return e.name
        if isinstance(e, FloorDiv):
            return div.format(p(e.args[0]), p(e.args[1]))
        if isinstance(e, MODS):
            return mod.format(p(e.args[0]), p(e.args[1]))
        if isinstance(e, sympy.Min):
            return _fold(lo, [p(a) for a in e.args])
        if isinstance(e, sympy.Max):
            return _fold(hi, [p(a) for a in e.args])
        if isinstance(e, sympy.Add):
            terms = sorted(e.args, key=sympy.default_sort_key)
            return "(" + " + ".join(p(t) for t in terms) + ")"
        if isinstance(e, sympy.Mul):
            return "(" + " * ".join(p(t) for t in e.args) + ")"
        raise NotImplementedError(f"index expression {e} ({type(e).__name__})")

    return p(sympy.sympify(expr))


def _fold(fmt: str, args: list[str]) -> str:
    out = args[0]
    for a in args[1:]:
        out = fmt.format(out, a)
    return out

"""erf in C++ as a branch-free polynomial (``acc_erf``), so that loops calling it vectorize.

GCC's ``__builtin_erff`` is libm's scalar erff: a loop calling it stays scalar. A GELU's backward over a
4096 x 256 activation took 10 ms in a compiled region against ATen's 1.8 ms (its erf is a vector
polynomial), and a model of nn.GELU blocks trained 1.4x slower compiled than eager (2026-12-04).

Two pieces, both computed and one chosen, as ``acc_exp`` does:

- ``|x| < 1``: ``x * P(x^2)``, P of degree 5 (erf is odd; its series in x^2 converges fast there);
- ``|x| >= 1``: ``1 - exp(Q(t))`` with t = min(|x|, 4) and the sign of x, Q of degree 8 fitted to
  log(erfc(t)). erf(4) rounds to 1 in fp32, so t stops there; a NaN passes through (t is NaN, and so
  is ``acc_exp`` of it).

``fit()`` made the coefficients: least squares on 4,000 Chebyshev points of each interval, against
Python's ``math.erf``/``math.erfc`` in float64, relative to erf for P. Evaluated in float32 they are
within 2.3 ulp of erf on [-6, 6] and down to 1e-30 (``tests/compile/test_codegen_cpp.py`` checks the
compiled kernel against ``math.erf``).
"""

from __future__ import annotations

SPLIT = 1.0
TOP = 4.0
# Highest power first.
SMALL = (-5.625396e-4, 4.9160235e-3, -2.670995e-2, 0.112801306, -0.3761232, 1.1283791)
LARGE = (1.6140616e-06, -4.5590623e-05, 5.9276953e-4, -4.7402224e-3, 2.6364718e-2, -0.10997824,
         -0.6319371, -1.1301666, 3.0321296e-4)  # fmt: skip


def _horner(var: str, coeffs: tuple[float, ...], out: str) -> str:
    lines = [f"    float {out} = {coeffs[0]!r}f;"]
    lines += [f"    {out} = {out} * {var} + {c!r}f;" for c in coeffs[1:]]
    return "\n".join(lines)


# Needs acc_exp (codegen/cpp.py's prelude puts this after it).
ERF = f"""
// erf, branch-free so loops vectorize; codegen/erf_poly.py has the polynomials.
static inline float acc_erf(float x) {{
    const float a = __builtin_fabsf(x);
    const float s = x * x;
{_horner("s", SMALL, "p")}
    const float t = a > {TOP}f ? {TOP}f : a;
{_horner("t", LARGE, "q")}
    const float large = __builtin_copysignf(1.0f - acc_exp(q), x);
    return a < {SPLIT}f ? x * p : large;
}}
"""


def fit(small_degree: int = 5, large_degree: int = 8, points: int = 4000) -> tuple[list[float], list[float]]:
    """(SMALL, LARGE) fitted afresh (numpy; not needed at run time)."""
    import math

    import numpy as np

    k = np.arange(points)
    chebyshev = (1 - np.cos(np.pi * (k + 0.5) / points)) / 2  # in [0, 1], dense at both ends
    s = SPLIT**2 * chebyshev
    x = np.sqrt(s)
    ratio = np.array([math.erf(v) / v if v > 0 else 2 / math.sqrt(math.pi) for v in x])
    # relative error: each row divided by the value it should give
    small, *_ = np.linalg.lstsq(np.vander(s, small_degree + 1) / ratio[:, None], np.ones(points), rcond=None)
    t = SPLIT + (TOP - SPLIT) * chebyshev
    large, *_ = np.linalg.lstsq(np.vander(t, large_degree + 1), np.log([math.erfc(v) for v in t]), rcond=None)
    return [float(np.float32(c)) for c in small], [float(np.float32(c)) for c in large]

"""Numbers as people read them in reports (markdown, HTML, the terminal): None is "n/a"."""

from __future__ import annotations

import math


def num(x: float | None) -> str:
    """Four significant digits."""
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def loss(x: float | None) -> str:
    """Four significant digits, trailing zeros kept: losses in a column line up (2.790 beside 2.787,
    not 2.79)."""
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    return f"{x:#.4g}".removesuffix(".")  # (1234. -> 1234)


def integer(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def secs(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def nbytes(x: int | None) -> str:
    if x is None:
        return "n/a"
    if x < 1024:
        return f"{x} B"
    value, unit = x / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.2f} {unit}"

"""A region compiled for any length, run once at short lengths against its own ATen ops.

``codegen.linear_sizes`` writes a region's kernels from three long made-up lengths, where each number
that follows the length must be ``a·s + b`` at all three. A number that only looks so there (an index
reduced modulo the length where it is shorter than the length, a bound clamped at a fixed size) would
be wrong below them. So each such region is built, then run at ``SHORT_LENGTHS`` on random inputs in
the inputs' own layouts beside the region's own graph (``lower._checked_at_build``); a difference
sends it to the next executor with the length and the largest difference as the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from accelrun.compile.codegen.runtime_rows import _values, symbolic

SHORT_LENGTHS = (1, 2, 3, 7, 33)


def differs_at_short_lengths(region: Any, compiled: Any, symbol: str) -> str | None:
    """Run the compiled region and the region's ATen ops on the same random inputs at each of
    ``SHORT_LENGTHS`` (where every size is at least 1); how they differ, or None. The kernels were
    written from three long probes, so a short length is where a size-dependent simplification that
    held at all three would be wrong."""
    g = torch.Generator().manual_seed(0)
    values = _values(region)
    # bf16 kernels compute in fp32 and round at their stores; eager rounds after every op.
    low_precision = any(isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16) for v in values)
    rtol = 2e-2 if low_precision else 1e-3
    metas = region.input_meta
    for s in SHORT_LENGTHS:
        if any(_at(n, symbol, s) < 1 for v in values if isinstance(v, torch.Tensor) for n in v.shape):
            continue  # a size such as s - 3: the graph is not for lengths that short
        shapes = [[_at(n, symbol, s) for n in m.shape] if isinstance(m, torch.Tensor) else None for m in metas]
        inputs = [_random_like(m, shape, [_at(n, symbol, s) for n in m.stride()], g) if shape is not None
                  else _at(m, symbol, s) for m, shape in zip(metas, shapes, strict=True)]  # fmt: skip
        with torch.no_grad():
            want = region.gm(*inputs)
            got = compiled(*inputs)
        want = tuple(want) if isinstance(want, (tuple, list)) else (want,)
        for k, (w, o) in enumerate(zip(want, got, strict=False)):
            if not isinstance(w, torch.Tensor):
                continue
            if w.shape != o.shape or not _close(o.float(), w.float(), rtol, normwise=low_precision):
                how = (f"largest difference {(o.float() - w.float()).abs().max().item():.3g} (largest value "
                       f"{w.float().abs().max().item():.3g})" if w.shape == o.shape
                       else f"shape {list(o.shape)}, not {list(w.shape)}")  # fmt: skip
                return (f"at length {s} (kernels written from long made-up lengths) output {k} differs from the "
                        f"region's ops: {how}")
    return None


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, normwise: bool) -> bool:
    """Element by element; or, for bf16 (eager rounds after every op, the kernels at their stores),
    every difference against the output's largest value: a wrong index is off by the values' own size."""
    if not normwise:
        return torch.allclose(got, want, rtol=rtol, atol=rtol, equal_nan=True)
    same_nans = torch.equal(got.isnan(), want.isnan())
    diff = (got - want).nan_to_num(0.0).abs().max().item() if got.numel() else 0.0
    scale = want.nan_to_num(0.0).abs().max().item() if want.numel() else 0.0
    return same_nans and diff <= rtol * max(scale, 1.0)


def _at(n: Any, symbol: str, s: int) -> int:
    """A size or stride of the region's (an int, or an expression of the length) at length ``s``."""
    if not symbolic(n):
        return int(n)
    expr = n.node.expr
    return int(expr.subs({x: s for x in expr.free_symbols if x.name == symbol}))


def _random_like(meta: torch.Tensor, shape: list[int], stride: list[int], g: torch.Generator) -> torch.Tensor:
    """Random values in the input's own layout (an expanded axis stays one element, stride 0)."""
    own = [1 if st == 0 else n for n, st in zip(shape, stride, strict=True)]
    if meta.dtype.is_floating_point:
        values = torch.randn(own, generator=g).to(meta.dtype)
    elif meta.dtype == torch.bool:
        values = torch.rand(own, generator=g) < 0.5
    else:
        values = torch.zeros(own, dtype=meta.dtype)  # indices: 0 is in range for any axis they index
    return torch.empty_strided(own, stride, dtype=meta.dtype).copy_(values).expand(shape)

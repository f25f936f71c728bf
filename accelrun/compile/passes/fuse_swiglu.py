"""fuse_swiglu: ``silu(a) * b`` (silu as F.silu or as ``a * sigmoid(a)``) -> fused SwiGLU gate.

The replacement ``accelrun.compile.fused.swiglu.swiglu`` saves a and b for the backward and recomputes
sigmoid(a), instead of autograd's saving of sigmoid(a) and silu(a) as well.
"""

from __future__ import annotations

from torch import fx

from accelrun.compile.fused.swiglu import swiglu
from accelrun.compile.passes.base import PassContext, PassResult, register_pass
from accelrun.compile.pattern import (
    Match,
    OneOf,
    Op,
    Tensor,
    example_value,
    iter_matches,
    replace_with_call,
    rewrite_all,
)
from accelrun.config.compile_names import FuseSwiGLUOptions

_A = Tensor("a")
PATTERN = Op("mul", OneOf(Op("silu", _A), Op("mul", _A, Op("sigmoid", _A))), Tensor("b"))


def _acceptable(m: Match) -> bool:
    a, b = example_value(m["a"]), example_value(m["b"])
    return a is not None and b is not None and a.dtype.is_floating_point and b.dtype.is_floating_point


def _rewrite(gm: fx.GraphModule, anchor: fx.Node) -> fx.Node | None:
    for m in iter_matches(PATTERN, anchor):
        if _acceptable(m):
            return replace_with_call(gm, m, swiglu, (m["a"], m["b"]))
    return None


@register_pass("fuse_swiglu", "pre_grad", FuseSwiGLUOptions)
def fuse_swiglu(gm: fx.GraphModule, options: FuseSwiGLUOptions, ctx: PassContext) -> PassResult:
    """Replace silu(a) * b with one fused op whose backward recomputes sigmoid(a)."""
    n = rewrite_all(gm, {"mul"}, _rewrite)
    return PassResult(changed=n > 0, summary=f"matched {n} SwiGLU", counts={"matched": n})

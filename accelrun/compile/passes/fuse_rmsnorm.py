"""fuse_rmsnorm: ``x * rsqrt(mean(x^2, -1, keepdim=True) + eps) [.type_as(x)] [* weight]`` -> fused RMSNorm.

Matches the spellings models use: x.pow(2) / x**2 / x*x / x.square(); Tensor.mean / torch.mean;
x * rsqrt(...) or x / sqrt(...); an fp32 upcast (``.float()`` / ``.to(torch.float32)``) on x, and the cast
back (``.type_as(x)`` / ``.to(x.dtype)``) before the weight, as llama.py writes it. The replacement is
``accelrun.compile.fused.rmsnorm.rms_norm``, whose backward saves only x and the per-row rstd.
"""

from __future__ import annotations

from torch import fx

from accelrun.compile.fused.rmsnorm import rms_norm
from accelrun.compile.passes.base import PassContext, PassResult, register_pass
from accelrun.compile.pattern import (
    Lit,
    Match,
    OneOf,
    Op,
    Tensor,
    Var,
    example_value,
    float32_cast,
    is_dim,
    is_scalar,
    iter_matches,
    replace_with_call,
    rewrite_all,
    same_shape,
)
from accelrun.config.compile_names import FuseRMSNormOptions


def _pattern(upcast: bool):
    x = Tensor("x")
    # x appears up to three times; with `upcast` every use goes through its own (or a shared) cast.
    xc = float32_cast(x) if upcast else x
    square = OneOf(Op("pow", xc, Lit(2)), Op("mul", xc, xc), Op("square", xc))
    denom = Op("add", Op("mean", square, Var("dim"), keepdim=Lit(True)), Var("eps", is_scalar))
    normed = OneOf(Op("mul", xc, Op("rsqrt", denom)), Op("div", xc, Op("sqrt", denom)))
    cast = OneOf(Op("type_as", normed, x, name="cast"), Op("to", normed, Var("to_dtype"), name="cast"), normed)
    return OneOf(Op("mul", cast, Tensor("weight"), name="scaled"), cast)


PATTERNS = ((True, _pattern(True)), (False, _pattern(False)))


def _acceptable(m: Match) -> bool:
    x = example_value(m["x"])
    ndim = None if x is None else len(x.shape)
    if not is_dim(m["dim"], ndim, -1):
        return False
    if x is not None and not x.dtype.is_floating_point:
        return False
    if "to_dtype" in m.bindings and (x is None or m["to_dtype"] != x.dtype):
        return False  # a cast to some other dtype than x's is not llama's cast back
    if "weight" in m.bindings:
        # Only a per-feature weight: anything else multiplied in stays outside the fused op.
        w = example_value(m["weight"])
        if x is None or w is None or not same_shape(w.shape, x.shape[-1:]) or not w.dtype.is_floating_point:
            return False
    return True


def _rewrite(gm: fx.GraphModule, anchor: fx.Node) -> fx.Node | None:
    for upcast, pattern in PATTERNS:
        for m in iter_matches(pattern, anchor):
            if _acceptable(m):
                cast_back = "cast" in m.bindings
                eps = m["eps"] if isinstance(m["eps"], fx.Node) else float(m["eps"])  # a node: symbolic
                args = (m["x"], m.get("weight"), eps, upcast, cast_back)
                return replace_with_call(gm, m, rms_norm, args)
    return None


@register_pass("fuse_rmsnorm", "pre_grad", FuseRMSNormOptions)
def fuse_rmsnorm(gm: fx.GraphModule, options: FuseRMSNormOptions, ctx: PassContext) -> PassResult:
    """Replace RMSNorm written out in torch ops with one fused op (forward + lean backward)."""
    n = rewrite_all(gm, {"mul", "div", "type_as", "to"}, _rewrite)
    return PassResult(changed=n > 0, summary=f"matched {n} RMSNorm", counts={"matched": n})

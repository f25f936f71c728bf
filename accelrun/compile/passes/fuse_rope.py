"""fuse_rope: llama.py's ``apply_rope`` (adjacent-pair rotary embeddings) -> fused rotary op.

Matches ``x[.float()].unflatten(-1, (-1, 2)).unbind(-1)`` -> x0, x1, then
``stack((x0*cos - x1*sin, x0*sin + x1*cos), -1).flatten(-2)[.type_as(x)]``, with cos and sin any tensors
(multiplications in either order). The replacement ``accelrun.compile.fused.rope.rope`` has a backward
that rotates the gradient back and saves only cos and sin.
"""

from __future__ import annotations

from torch import fx

from accelrun.compile.fused.rope import rope
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
    iter_matches,
    replace_with_call,
    rewrite_all,
)
from accelrun.config.compile_names import FuseRopeOptions


def _pattern(upcast: bool):
    x = Tensor("x")
    xc = float32_cast(x) if upcast else x
    pairs = Op("unbind", Op("unflatten", xc, Var("unflatten_dim"), Var("sizes")), Var("unbind_dim"), name="pairs")
    x0, x1 = Op("getitem", pairs, Lit(0), name="x0"), Op("getitem", pairs, Lit(1), name="x1")
    cos, sin = Tensor("cos"), Tensor("sin")
    rotated0 = Op("sub", Op("mul", x0, cos), Op("mul", x1, sin))
    rotated1 = Op("add", Op("mul", x0, sin), Op("mul", x1, cos))
    out = Op("flatten", Op("stack", [rotated0, rotated1], Var("stack_dim")), Var("flatten_start"))
    return OneOf(Op("type_as", out, x, name="cast"), out)


PATTERNS = ((True, _pattern(True)), (False, _pattern(False)))


def _acceptable(m: Match) -> bool:
    x = example_value(m["x"])
    if x is None or not x.dtype.is_floating_point or not isinstance(x.shape[-1], int) or x.shape[-1] % 2:
        return False
    ndim = len(x.shape)
    sizes = m["sizes"]
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 2 and sizes[1] == 2):
        return False
    if sizes[0] not in (-1, x.shape[-1] // 2):
        return False
    # unflatten the last dim of x (ndim), unbind the pair dim (ndim + 1), stack it back, flatten it.
    return (
        is_dim(m["unflatten_dim"], ndim, -1)
        and is_dim(m["unbind_dim"], ndim + 1, -1)
        and is_dim(m["stack_dim"], ndim + 1, -1)
        and is_dim(m["flatten_start"], ndim + 1, -2)
    )


def _rewrite(gm: fx.GraphModule, anchor: fx.Node) -> fx.Node | None:
    for upcast, pattern in PATTERNS:
        for m in iter_matches(pattern, anchor):
            if _acceptable(m):
                args = (m["x"], m["cos"], m["sin"], upcast, "cast" in m.bindings)
                return replace_with_call(gm, m, rope, args)
    return None


@register_pass("fuse_rope", "pre_grad", FuseRopeOptions)
def fuse_rope(gm: fx.GraphModule, options: FuseRopeOptions, ctx: PassContext) -> PassResult:
    """Replace llama.py's rotary embedding (pairs rotated by cos/sin) with one fused op."""
    n = rewrite_all(gm, {"flatten", "type_as"}, _rewrite)
    return PassResult(changed=n > 0, summary=f"matched {n} RoPE", counts={"matched": n})

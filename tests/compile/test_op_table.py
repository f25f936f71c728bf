"""One op table (codegen.ops.OPS): each renderer spells every op, composes it from others, or says why not."""

from __future__ import annotations

import pytest

from accelrun.compile.codegen.cpp import CPP
from accelrun.compile.codegen.ops import OPS, Unsupported
from accelrun.compile.codegen.triton import TRITON

RENDERERS = [CPP, TRITON]


@pytest.mark.parametrize("renderer", RENDERERS, ids=lambda r: r.name)
def test_every_op_of_the_table_renders_or_is_missing_with_a_reason(renderer):
    unexplained = []
    for name, info in OPS.items():
        args = tuple(f"a{i}" for i in range(info.arity))
        if name in renderer.missing:
            assert renderer.missing[name].strip(), f"{renderer.name} lists {name} as missing without a reason"
            with pytest.raises(Unsupported, match=name):
                renderer.op(name, *args)
            continue
        try:
            text = renderer.op(name, *args)
        except Unsupported:
            unexplained.append(name)
            continue
        assert all(a in text for a in args), f"{renderer.name}'s {name} drops an operand: {text}"
    assert not unexplained, f"{renderer.name} has no form for {unexplained} and does not say why"


@pytest.mark.parametrize("renderer", RENDERERS, ids=lambda r: r.name)
def test_renderers_spell_only_ops_of_the_table(renderer):
    assert set(renderer.primitives) <= set(OPS), set(renderer.primitives) - set(OPS)
    assert set(renderer.missing) <= set(OPS)
    assert not set(renderer.missing) & set(renderer.primitives)


def test_composites_are_written_once():
    # NaN-propagating max/min and sigmoid come from the table on both backends, not from their primitives.
    for name in ("maximum", "minimum", "sigmoid"):
        assert OPS[name].compose is not None
        assert all(name not in r.primitives for r in RENDERERS)
    assert CPP.op("maximum", "x", "y") == "(((x != x) || (x > y)) ? x : y)"
    assert TRITON.op("sigmoid", "x") == "(1.0 / (1.0 + tl.exp((-x))))"


def test_an_op_outside_the_table_is_unsupported_with_its_name():
    with pytest.raises(Unsupported, match="op frobnicate has no C\\+\\+ form"):
        CPP.op("frobnicate", "x")

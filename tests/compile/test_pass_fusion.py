"""Pattern-fusion passes on Dynamo graphs: what they match, what they leave alone, and that the rewritten
graph computes the same loss and gradients as eager (also through AOTAutograd, as the backend runs it)."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified

from accelrun.compile.fused import linear_cross_entropy, rms_norm, rope, swiglu
from accelrun.compile.passes.base import PassContext, registered_passes, resolve_passes
from accelrun.compile.pattern import Op, Tensor, canonical_op, iter_matches, normalized_args
from accelrun.models.families.llama.model import (
    Llama,
    LlamaArgs,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    rope_tables,
)

FUSION_PASSES = ["fuse_attention", "cpu_attention", "fuse_rmsnorm", "fuse_swiglu", "fuse_rope", "merge_parallel_linears",
                 "fuse_linear_cross_entropy"]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


class Fused:
    """A torch.compile backend that runs fusion passes on Dynamo's graph and records what they did."""

    def __init__(self, passes: list, aot: bool = False) -> None:
        self.passes = resolve_passes(passes)
        self.aot = aot
        self.counts: dict[str, int] = {}
        self.gm: fx.GraphModule | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs):
        for p in self.passes:
            result = p.spec.fn(gm, p.options, PassContext("pre_grad", list(example_inputs)))
            gm.graph.lint()
            self.counts[p.name] = self.counts.get(p.name, 0) + result.counts["matched"]
        self.gm = gm
        if not self.aot:
            return gm.forward  # the fused ops run eagerly; autograd goes through their Functions
        boxed = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
        return aot_module_simplified(gm, example_inputs, fw_compiler=boxed, bw_compiler=boxed)

    def targets(self) -> list:
        return [n.target for n in self.gm.graph.nodes if n.op == "call_function"]

    def node(self, target) -> fx.Node:
        return next(n for n in self.gm.graph.nodes if n.target is target)


def run_both(fn, inputs, passes, aot=False, tol=None, dynamic=False):
    """Run ``fn`` eagerly and compiled with ``passes``; outputs and gradients must agree. -> backend."""
    backend = Fused(passes, aot)
    eager_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    fused_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    expected = fn(*eager_in)
    got = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*fused_in)
    dtype = next(t.dtype for t in inputs if t.is_floating_point())
    tol = tol or TOL[dtype]
    torch.testing.assert_close(got, expected, **tol)
    cotangent = randn(*expected.shape, seed=99, dtype=expected.dtype)
    expected.backward(cotangent)
    got.backward(cotangent)
    for a, b in zip(eager_in, fused_in, strict=True):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, **tol)
    return backend


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- the matcher ---------------------------------------------------------------------------------


def test_every_spelling_of_mul_is_canonical_mul():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    spellings = [
        g.call_function(operator.mul, (a, b)), g.call_function(torch.mul, (a, b)),
        g.call_function(torch.Tensor.mul, (a, b)), g.call_method("mul", (a, b)),
    ]  # fmt: skip
    assert [canonical_op(n) for n in spellings] == ["mul"] * 4
    power = g.call_function(torch.pow, (a,), {"exponent": 2})
    assert normalized_args(power) == {"input": a, "other": 2}
    where = g.call_method("where", (a, b, 0.0))  # Tensor.where puts self second: not torch.where's order
    assert canonical_op(where) is None


def test_op_patterns_commute_and_insist_on_defaults():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    swapped = g.call_function(operator.mul, (y, g.call_function(torch.sigmoid, (x,))))
    pattern = Op("mul", Op("sigmoid", Tensor("x")), Tensor("y"))
    (match,) = list(iter_matches(pattern, swapped))
    assert match["x"] is x and match["y"] is y
    scaled_add = g.call_function(torch.add, (x, y), {"alpha": 2})
    assert not list(iter_matches(Op("add", Tensor("x"), Tensor("y")), scaled_add))


def test_interior_value_used_elsewhere_blocks_the_match():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    sig = g.call_function(torch.sigmoid, (x,))
    out = g.call_function(operator.mul, (sig, y))
    g.output((out, sig))
    assert not list(iter_matches(Op("mul", Op("sigmoid", Tensor("x")), Tensor("y")), out))


def test_fusion_passes_are_registered_pre_grad():
    registry = registered_passes()
    for name in FUSION_PASSES:
        assert registry[name].stage == "pre_grad", name
    (configured,) = resolve_passes([{"fuse_linear_cross_entropy": {"chunk_rows": 128}}])
    assert configured.options.chunk_rows == 128


# --- RMSNorm ------------------------------------------------------------------------------------


def rms_plain(x, w):
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6) * w


def rms_div(x, w):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def rms_to(x, w):
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + 1e-5)).to(x.dtype) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_llama_module(dtype):
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(randn(16, seed=1))
    backend = run_both(lambda x: norm(x), [randn(2, 3, 16, dtype=dtype)], ["fuse_rmsnorm"])
    assert backend.counts == {"fuse_rmsnorm": 1}
    fused = backend.node(rms_norm)
    assert fused.args[2:] == (1e-5, True, True)  # eps, upcast, cast back: llama.py's float()/type_as


@pytest.mark.parametrize("fn, dtype", [(rms_plain, torch.float32), (rms_div, torch.float32), (rms_to, torch.bfloat16)])
def test_rmsnorm_spellings(fn, dtype):
    backend = run_both(fn, [randn(4, 8, dtype=dtype), randn(8, seed=1)], ["fuse_rmsnorm"])
    assert backend.counts == {"fuse_rmsnorm": 1}
    assert canonical_op(backend.node(rms_norm).args[1]) is None  # the weight went into the fused op


def test_rmsnorm_near_misses():
    def rstd_escapes(x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * rstd + rstd

    def wrong_dim(x):
        return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)

    for fn in (rstd_escapes, wrong_dim):
        assert run_both(fn, [randn(4, 8)], ["fuse_rmsnorm"]).counts == {"fuse_rmsnorm": 0}, fn.__name__


def test_rmsnorm_leaves_a_non_feature_weight_outside():
    def gated(x, gate):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gate

    backend = run_both(gated, [randn(4, 8), randn(4, 8, seed=1)], ["fuse_rmsnorm"])
    assert backend.counts == {"fuse_rmsnorm": 1}
    assert backend.node(rms_norm).args[1] is None and operator.mul in backend.targets()

    def squared(x):  # the normalised value is the "weight" too: it cannot be both consumed and read
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y * y

    backend = run_both(squared, [randn(4, 8)], ["fuse_rmsnorm"])
    assert backend.counts == {"fuse_rmsnorm": 1}
    assert backend.node(rms_norm).args[1] is None and operator.mul in backend.targets()


# --- SwiGLU, RoPE --------------------------------------------------------------------------------


def swiglu_functional(a, b):
    return F.silu(a) * b


def swiglu_sigmoid(a, b):
    return b * (a * torch.sigmoid(a))


@pytest.mark.parametrize("fn", [swiglu_functional, swiglu_sigmoid])
def test_swiglu_spellings(fn):
    backend = run_both(fn, [randn(4, 8), randn(4, 8, seed=1)], ["fuse_swiglu"])
    assert backend.counts == {"fuse_swiglu": 1} and swiglu in backend.targets()


def test_swiglu_not_when_silu_is_used_elsewhere():
    def silu_escapes(a, b):
        s = F.silu(a)
        return s * b + s

    assert run_both(silu_escapes, [randn(4, 8), randn(4, 8, seed=1)], ["fuse_swiglu"]).counts == {"fuse_swiglu": 0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_llama(dtype):
    cos, sin = rope_tables(8, 6, 10000.0)
    backend = run_both(lambda x: apply_rope(x, cos, sin), [randn(2, 6, 3, 8, dtype=dtype)], ["fuse_rope"])
    assert backend.counts == {"fuse_rope": 1}
    assert backend.node(rope).args[3:] == (True, True)


def test_rope_near_misses():
    cos, sin = rope_tables(8, 6, 10000.0)

    def wrong_sign(x):
        x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack((x0 * c + x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)

    def half_escapes(x):
        x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2) + x0.sum()

    for fn in (wrong_sign, half_escapes):
        assert run_both(fn, [randn(2, 6, 3, 8)], ["fuse_rope"]).counts == {"fuse_rope": 0}, fn.__name__


# --- attention ------------------------------------------------------------------------------------


def attn_triu_masked_fill(q, k, v):
    T = q.shape[-2]
    scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1)))
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1), float("-inf"))
    return F.softmax(scores.float(), dim=-1).type_as(q) @ v


def attn_tril_where(q, k, v):
    T = q.size(-2)
    keep = torch.tril(torch.ones(T, T, dtype=torch.bool))
    scores = torch.where(keep, torch.matmul(q, k.mT) / math.sqrt(q.size(-1)), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attn_prescaled_unmasked(q, k, v):
    return ((q * 0.25) @ k.transpose(2, 3)).softmax(-1).matmul(v)


@pytest.mark.parametrize("fn", [attn_triu_masked_fill, attn_tril_where])
def test_causal_attention_becomes_sdpa_is_causal(fn):
    q, k, v = (randn(2, 3, 5, 8, seed=s) for s in range(3))
    backend = run_both(fn, [q, k, v], ["fuse_attention"])
    assert backend.counts == {"fuse_attention": 1}
    sdpa = backend.node(F.scaled_dot_product_attention)
    assert sdpa.kwargs["is_causal"] is True and sdpa.kwargs["attn_mask"] is None
    assert sdpa.kwargs["scale"] == pytest.approx(1 / math.sqrt(8))
    assert torch.triu not in backend.targets() and torch.tril not in backend.targets()  # mask code is gone


def test_prescaled_attention_keeps_its_scale():
    q, k, v = (randn(2, 3, 5, 8, seed=s) for s in range(3))
    backend = run_both(attn_prescaled_unmasked, [q, k, v], ["fuse_attention"])
    sdpa = backend.node(F.scaled_dot_product_attention)
    assert sdpa.kwargs["scale"] == 0.25 and sdpa.kwargs["is_causal"] is False


def test_attention_with_mask_inputs():
    q, k, v = (randn(2, 3, 5, 8, seed=s) for s in range(3))
    drop = (randn(5, 5, seed=9) > 0) & ~torch.eye(5, dtype=torch.bool)  # every row keeps its diagonal

    def bool_mask(q, k, v, drop):
        return (q @ k.transpose(-2, -1) / 4.0).masked_fill(drop, float("-inf")).softmax(-1) @ v

    backend = run_both(bool_mask, [q, k, v, drop], ["fuse_attention"])
    sdpa = backend.node(F.scaled_dot_product_attention)
    assert sdpa.kwargs["attn_mask"].target is torch.logical_not and sdpa.kwargs["is_causal"] is False

    def additive(q, k, v, bias):
        return F.softmax(q @ k.transpose(-2, -1) * 0.5 + bias, dim=-1) @ v

    backend = run_both(additive, [q, k, v, randn(3, 5, 5, seed=8)], ["fuse_attention"])
    assert backend.node(F.scaled_dot_product_attention).kwargs["attn_mask"].op == "placeholder"


def test_attention_near_misses():
    q, k, v = (randn(2, 3, 5, 8, seed=s) for s in range(3))

    def softmax_over_queries(q, k, v):
        return F.softmax(q @ k.transpose(-2, -1), dim=-2) @ v

    def probs_escape(q, k, v):
        p = F.softmax(q @ k.transpose(-2, -1), dim=-1)
        return p @ v + p.sum()

    for fn in (softmax_over_queries, probs_escape):
        assert run_both(fn, [q, k, v], ["fuse_attention"]).counts == {"fuse_attention": 0}, fn.__name__


# --- linear + cross-entropy ----------------------------------------------------------------------


def head_loss(h, w, t):
    return F.cross_entropy(F.linear(h, w).float().flatten(0, 1), t.flatten())


def matmul_sum_loss(h, w, t):
    logits = (h @ w.t()).view(-1, w.shape[0])
    return F.cross_entropy(logits, t.view(-1), ignore_index=-1, reduction="sum")


def biased_loss(h, w, b, t):
    return F.cross_entropy(F.linear(h, w, b).flatten(0, 1), t.flatten())


def test_linear_cross_entropy_spellings():
    h, w, t = randn(2, 6, 8), randn(10, 8, seed=1), torch.randint(0, 10, (2, 6), generator=torch.Generator())
    t[0, 0] = -100  # ignored (F.cross_entropy's default ignore_index)
    option = [{"fuse_linear_cross_entropy": {"chunk_rows": 5}}]
    backend = run_both(head_loss, [h, w, t], option)
    assert backend.counts == {"fuse_linear_cross_entropy": 1}
    fused = backend.node(linear_cross_entropy)
    assert fused.args[4:] == (-100, "mean", 5, True)  # ignore_index, reduction, chunk rows, upcast
    backend = run_both(biased_loss, [h, w, randn(10, seed=2), t], option)
    assert backend.node(linear_cross_entropy).args[2].op == "placeholder"
    t[0, 0] = -1
    assert run_both(matmul_sum_loss, [h, w, t], option).node(linear_cross_entropy).args[4:6] == (-1, "sum")


def test_linear_cross_entropy_only_when_logits_have_no_other_user():
    h, w, t = randn(2, 6, 8), randn(10, 8, seed=1), torch.randint(0, 10, (2, 6), generator=torch.Generator())

    def logits_escape(h, w, t):
        logits = F.linear(h, w)
        return F.cross_entropy(logits.flatten(0, 1), t.flatten()) + logits.mean()

    def smoothed(h, w, t):
        return F.cross_entropy(F.linear(h, w).flatten(0, 1), t.flatten(), label_smoothing=0.1)

    for fn in (logits_escape, smoothed):
        backend = run_both(fn, [h, w, t], ["fuse_linear_cross_entropy"])
        assert backend.counts == {"fuse_linear_cross_entropy": 0}, fn.__name__


def test_dynamic_shapes_symbolic_eps_and_rows():
    # dynamic=True makes Dynamo pass RMSNorm's eps as a graph value and the row count as a symbol.
    norm = RMSNorm(8)
    backend = run_both(lambda x: norm(x), [randn(3, 5, 8)], ["fuse_rmsnorm"], aot=True, dynamic=True)
    assert backend.counts == {"fuse_rmsnorm": 1}
    h, w, t = randn(2, 6, 8), randn(10, 8, seed=1), torch.randint(0, 10, (2, 6), generator=torch.Generator())
    option = [{"fuse_linear_cross_entropy": {"chunk_rows": 5}}]
    backend = run_both(head_loss, [h, w, t], option, aot=True, dynamic=True)
    assert backend.node(linear_cross_entropy).args[6] == 5


# --- merge_parallel_linears ----------------------------------------------------------------------


def qkv(x, wq, wk, wv):
    q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
    return q * k.sigmoid() + v.tanh()  # each output used differently


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_narrow_projections_of_one_input_become_one_linear(dtype):
    scale = 24**-0.5  # unit-sized outputs, as initialised weights give
    args = [randn(2, 5, 24, dtype=dtype), *(randn(8, 24, seed=s).mul(scale).to(dtype) for s in (1, 2, 3))]
    backend = run_both(qkv, args, ["merge_parallel_linears"], aot=True)
    assert backend.counts == {"merge_parallel_linears": 1}
    assert backend.targets().count(torch._C._nn.linear) == 1 and torch.split in backend.targets()


def test_wide_biased_or_separate_linears_stay_apart():
    x, w1, w3 = randn(2, 5, 8), randn(24, 8, seed=1), randn(24, 8, seed=2)
    # Wider than their input (SwiGLU's w1 and w3): merging measured slower, so left alone.
    assert run_both(lambda x, a, b: F.linear(x, a) * F.linear(x, b), [x, w1, w3],
                    ["merge_parallel_linears"]).counts == {"merge_parallel_linears": 0}
    narrow = randn(4, 8, seed=3)
    with_bias = run_both(lambda x, a, b, c: F.linear(x, a, c) + F.linear(x, b).sum(-1, keepdim=True),
                         [x, randn(4, 8, seed=4), narrow, randn(4, seed=5)], ["merge_parallel_linears"])
    assert with_bias.counts == {"merge_parallel_linears": 0}
    other_input = run_both(lambda x, y, a, b: F.linear(x, a).sum() + F.linear(y, b).sum(),
                           [x, randn(2, 5, 8, seed=6), narrow, randn(4, 8, seed=7)], ["merge_parallel_linears"])
    assert other_input.counts == {"merge_parallel_linears": 0}


# --- end to end: the Llama block and model+loss through AOTAutograd ------------------------------

ARGS = LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
E2E_TOL = {"rtol": 1e-4, "atol": 1e-5}  # different (equally valid) summation orders in the backward


def test_llama_block_end_to_end():
    torch.manual_seed(0)
    block = TransformerBlock(ARGS)
    block.init_weights(0.02, 0.02)
    cos, sin = rope_tables(ARGS.head_dim, 8, ARGS.rope_theta)
    backend = Fused(FUSION_PASSES, aot=True)
    x = randn(2, 8, ARGS.dim)
    x_eager, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = block(x_eager, cos, sin)
    expected.square().sum().backward()
    eager_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    got = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)(x_fused, cos, sin)
    got.square().sum().backward()
    assert backend.counts == {"fuse_attention": 0, "cpu_attention": 0, "fuse_rmsnorm": 2, "fuse_swiglu": 1, "fuse_rope": 2,
                              "merge_parallel_linears": 1, "fuse_linear_cross_entropy": 0}  # fmt: skip
    torch.testing.assert_close(got, expected, **E2E_TOL)
    torch.testing.assert_close(x_fused.grad, x_eager.grad, **E2E_TOL)
    for name, p in block.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], **E2E_TOL, msg=name)


def test_llama_model_and_loss_end_to_end():
    model = Llama(ARGS)
    model.init_weights(seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, dims=1)

    def loss_fn(tokens, targets):
        return F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())

    expected = loss_fn(tokens, targets)
    expected.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    backend = Fused([*FUSION_PASSES[:-1], {"fuse_linear_cross_entropy": {"chunk_rows": 6}}], aot=True)
    got = torch.compile(loss_fn, backend=backend, fullgraph=True, dynamic=False)(tokens, targets)
    got.backward()
    assert backend.counts == {"fuse_attention": 0, "cpu_attention": 0, "fuse_rmsnorm": 3, "fuse_swiglu": 1, "fuse_rope": 2,
                              "merge_parallel_linears": 1, "fuse_linear_cross_entropy": 1}  # fmt: skip
    torch.testing.assert_close(got, expected, **E2E_TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], **E2E_TOL, msg=name)

"""The cpu_dropout pass: a training dropout on the CPU draws its mask inside the generated kernel
(fused/dropout.py's counter-based numbers) instead of ATen's bernoulli_.

Masks cannot equal eager's (another generator, as Inductor's), so the checks are: the generated C++
draws exactly the reference's numbers (and a region run as ATen calls the same), the output is the
input times the mask and 1 / (1 - p), the backward reads that same mask, torch.manual_seed decides
it, and the numbers behave like independent uniforms (drop rate, neighbours, calls)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.fused.dropout import SEED_HIGH, uniform_reference
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import PassContext, PassOptions, registered_passes
from tests.compile.user_models import VOCAB, NanoGPT

aten = torch.ops.aten


def _compiled(fn, executors=("cpp", "aten")):
    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(executors=list(executors), strict=True))
    return torch.compile(fn, backend=backend), backend


def _softmax_dropout(x):
    return F.dropout(torch.softmax(x, -1), 0.3, training=True) * 2 + 1


def _reference_keep(shape, p, seed=0):
    """The mask the compiled call draws after ``torch.manual_seed(seed)``: its one randint, then the
    reference generator."""
    torch.manual_seed(seed)
    return uniform_reference(torch.randint(0, SEED_HIGH, ()), list(shape)) >= p


def test_the_kernel_draws_the_reference_numbers_and_fuses_the_dropout():
    x = torch.randn(64, 300)
    fn, backend = _compiled(_softmax_dropout)
    torch.manual_seed(0)
    got = fn(x)
    keep = _reference_keep(x.shape, 0.3)
    want = torch.softmax(x, -1) * keep * (1 / 0.7) * 2 + 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got == 1, ~keep)  # the same elements dropped, not only as many
    # The softmax, the mask and the multiplies are one C++ region; no ATen dropout is left.
    (region,) = backend.record.regions  # an inference graph (x needs no gradient): one region
    assert region.executor == "cpp" and "dropout_uniform" in region.ops and "_softmax" in region.ops, region
    (rewrite,) = [p for p in backend.record.passes if p.name == "cpu_dropout"]
    assert rewrite.counts["rewritten"] == 1


def test_batches_of_changing_length_draw_the_reference_numbers_in_kernels_that_read_their_rows():
    """A dropout on [4, length, 48] activations whose length changes between calls: after the first
    length, one graph for every length whose region (the norm, the mask, the multiplies) reads its
    rows at each call and draws, for each length, exactly the reference's numbers over that shape.
    Until 2026-12-05 such dropouts stayed ATen's ("symbolic sizes")."""

    def fn(x):
        return F.dropout(F.layer_norm(x, (48,)), 0.25, training=True) + x

    compiled, backend = _compiled(fn)
    for length in (16, 24, 9, 40, 24):
        x = torch.randn(4, length, 48)
        torch.manual_seed(length)
        got = compiled(x)
        keep = _reference_keep(x.shape, 0.25, seed=length)
        want = F.layer_norm(x, (48,)) * keep * (1 / 0.75) + x
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    record = backend.record
    assert record.dynamo_graphs == 2, record.compiled_line()  # the first length, then any length
    rewrites = [p.counts["rewritten"] for p in record.passes if p.name == "cpu_dropout"]
    assert rewrites == [1, 1], rewrites
    last = [r for r in record.regions if r.graph.startswith("g1")]
    assert last and all(r.executor == "cpp" and r.runtime_rows for r in last), last
    assert any("dropout_uniform" in r.ops for r in last), last


@pytest.mark.parametrize("shape", [(4, None, 8), (4, 5, None)])
def test_a_dropout_whose_changing_size_no_kernel_reads_stays_atens(shape):
    """Rows of 8, or a changing size in the last axis (a [batch, channels, length] activation): the draw's
    index would split the changing rows, so no kernel for any length takes it. The dropout stays
    ATen's (its region would run as ATen calls), with the reason, and no size is read as a number:
    one graph for every length after the first, as without the pass."""

    def fn(x):
        return F.dropout(x * 2, 0.25, training=True) + x

    compiled, backend = _compiled(fn)
    for length in (16, 24, 9, 40):
        out = compiled(torch.randn(*[length if n is None else n for n in shape]))
        assert out.shape[shape.index(None)] == length
    record = backend.record
    assert record.dynamo_graphs == 2, record.compiled_line()
    rewrites = [p for p in record.passes if p.name == "cpu_dropout"]
    assert [p.counts["rewritten"] for p in rewrites] == [1, 0]
    assert "whose rows no kernel reads at each call" in rewrites[1].summary, rewrites[1].summary


@pytest.mark.parametrize("size", [[16, 33, 128], [7], [0, 5], [3, 1, 5]])
def test_the_op_run_as_aten_calls_fills_the_reference_numbers_in_compiled_code(size):
    """A region that runs as ATen calls draws through the op itself: a compiled loop of the same C++
    (the reference's integer tensor arithmetic is 5x slower than ATen's own dropout), bit for bit
    the reference's numbers."""
    from accelrun.compile.fused import dropout

    assert dropout._fill_library() is not None  # g++ is here: the compiled fill, not the reference
    seed = torch.tensor(1234567890123)
    assert torch.equal(torch.ops.accelrun.dropout_uniform(seed, size), uniform_reference(seed, size))


def test_a_region_run_as_aten_calls_draws_the_same_mask_bit_for_bit():
    x = torch.randn(40, 50)
    outs = []
    for executors in (("cpp", "aten"), ("aten",)):
        fn, backend = _compiled(lambda t: F.dropout(t, 0.25, training=True), executors)
        torch.manual_seed(7)
        outs.append(fn(x))
        assert backend.record.regions_per_executor() == {executors[0]: 1}, backend.record.regions_per_executor()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backward_reads_the_mask_the_forward_drew(dtype):
    x = torch.randn(32, 48, dtype=dtype).abs().add(0.5).requires_grad_()  # no zeros: a zero output is a drop
    fn, _ = _compiled(lambda t: F.dropout(t, 0.4, training=True))
    torch.manual_seed(3)
    y = fn(x)
    y.float().sum().backward()
    kept = y != 0
    assert torch.equal(kept, _reference_keep(x.shape, 0.4, seed=3))
    torch.testing.assert_close(y, (x * kept / 0.6).to(dtype), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
    torch.testing.assert_close(x.grad, (kept / 0.6).to(dtype), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)


def test_manual_seed_decides_the_mask_and_each_call_draws_anew():
    x = torch.ones(256, 256)
    fn, _ = _compiled(lambda t: F.dropout(t, 0.5, training=True))
    torch.manual_seed(11)
    first, second = fn(x), fn(x)
    torch.manual_seed(11)
    assert torch.equal(fn(x), first)
    agree = ((first == 0) == (second == 0)).float().mean().item()
    assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / x.numel()), agree  # two calls: independent masks


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_numbers_drop_at_rate_p_independently_of_their_neighbours(p):
    n = 1 << 20
    for seed in (0, 1, 2**61 + 12345):
        u = uniform_reference(torch.tensor(seed), [n])
        assert 0.0 <= u.min().item() and u.max().item() < 1.0
        drop = (u < p).float()
        assert abs(drop.mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n), (seed, drop.mean())
        both = (drop[1:] * drop[:-1]).mean().item()  # neighbours (a row's next element)
        assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n), (seed, both)
        assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    # Seeds one apart give unrelated masks.
    a, b = (uniform_reference(torch.tensor(s), [n]) < p for s in (41, 42))
    assert abs((a & b).float().mean().item() - p * p) < 5 * math.sqrt(p * p / n)


def _dropouts(gm):
    return [n for n in gm.graph.nodes if n.target is aten.native_dropout.default]


@pytest.mark.parametrize("case, why", [
    ("transposed", "input not contiguous"), ("fp16", "dtype torch.float16"), ("p_one", "p = 1.0"),
    ("eval", "not a training dropout with a fixed p"),
])  # fmt: skip
def test_dropouts_it_cannot_draw_stay_aten_s_with_the_reason(case, why):
    x = torch.randn(8, 12, dtype=torch.float16 if case == "fp16" else torch.float32)
    p, train = (1.0 if case == "p_one" else 0.2), case != "eval"
    fn = (lambda t: aten.native_dropout(t.t(), p, train)) if case == "transposed" else (
        lambda t: aten.native_dropout(t, p, train))  # fmt: skip
    gm = make_fx(fn, tracing_mode="fake")(x)
    result = registered_passes()["cpu_dropout"].fn(gm, PassOptions(), PassContext("forward"))
    assert not result.changed and result.counts == {"rewritten": 0, "kept": 1}
    assert why in result.summary and len(_dropouts(gm)) == 1


def test_a_nanogpt_shaped_model_trains_with_its_dropouts_in_kernels(tmp_path):
    from accelrun.compile.compile_model import compile_model
    from accelrun.config.schema import CompileConfig
    from accelrun.models.build import training_loss_fn, transformer_blocks

    torch.manual_seed(0)
    model = NanoGPT()
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    record = compile_model(model, transformer_blocks(model), cfg).record
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (4, 32), generator=gen) for _ in range(2))
    with torch.no_grad():  # evaluating: no dropout, eager's numbers
        torch.testing.assert_close(model.eval()(x), reference.eval()(x), rtol=1e-5, atol=1e-5)
    model.train(), reference.train()
    losses = {}
    for name, m in (("compiled", model), ("eager", reference)):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(40):
            loss = training_loss_fn(m)(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    # The same start (a dropout's expectation is the identity), then both learn the batch alike.
    assert abs(losses["compiled"][0] - losses["eager"][0]) < 0.1, losses
    assert losses["compiled"][-1] < 0.5 * losses["compiled"][0], losses["compiled"]
    assert abs(losses["compiled"][-1] - losses["eager"][-1]) < 0.25 * losses["eager"][0], losses
    rewritten = {p.graph: p.counts.get("rewritten", 0) for p in record.passes if p.name == "cpu_dropout"}
    # The blocks' training graph (after the evaluation's): both residuals' dropouts in regions, and
    # attention's in the C++ attention kernel (cpu_attention_dropout: the pass before this one).
    assert [n for g, n in rewritten.items() if g.endswith("forward")] == [2], rewritten
    drawn = [r for r in record.regions if "dropout_uniform" in r.ops]
    assert len(drawn) == 2 and all(r.executor == "cpp" for r in drawn), [(r.ops, r.executor) for r in drawn]
    matched = [p.counts.get("matched") for p in record.passes if p.name == "cpu_attention"]
    assert matched[-1] == 1, matched
    # What the report says (accelrun compare names it when curves part from eager's): per block graph,
    # the two residual dropouts and attention's.
    assert record.summary()["dropout_in_kernels"] == 3
    from accelrun.report.markdown import _compiler_section

    assert any("dropout drawn in accelrun's kernels" in line and "| 3 call(s)" in line
               for line in _compiler_section(record.summary()))  # fmt: skip

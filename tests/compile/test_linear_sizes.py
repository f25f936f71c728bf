"""C++ kernels whose sizes follow a changing length read at each call (codegen/linear_sizes.py): regions
traced with a symbolic length where runtime rows do not apply (the length past a tensor's leading axis,
transposed layouts), lowered once, run for many lengths against float64 eager; what must be refused,
with its reason; the compiled form through a pickle (the graph cache); users' models on changing
lengths at eager's losses with such regions."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from accelrun.compile.codegen.cpp import CppLengthRegion, cpp_region, cpp_source
from accelrun.compile.codegen.cpp_build import build_library, load_library
from accelrun.compile.codegen.linear_sizes import PROBES, Linear, fit, lower_with_linear_sizes
from accelrun.compile.codegen.loop_ir import Unsupported
from accelrun.compile.codegen.runtime_rows import lower_with_runtime_rows
from tests.compile.test_runtime_rows import _region

LENGTHS = (2, 3, 7, 40, 129, 1000)


def test_fit_takes_the_probes_to_whole_numbers_only_along_a_line():
    assert fit(tuple(4 * p + 2 for p in PROBES)) == Linear(4, 2)
    assert fit(tuple(p % 64 for p in PROBES)) is None  # a number that depends on divisibility
    assert fit((1, 2, 3)) is None
    assert Linear(0, 5).cpp() == "5" and Linear(1, 0).cpp() == "(n)" and Linear(64, -2).cpp() == "(64 * n - 2)"


def test_a_negative_number_that_follows_the_length_keeps_its_sign():
    """g++'s INT64_C pastes a suffix onto its literal: the literal must be rewritten as a cast before
    a number in it becomes an expression of n (INT64_C(-(n)) does not build)."""
    from accelrun.compile.codegen.linear_sizes import _INT64_C, _template

    sources = [_INT64_C.sub(r"((int64_t)\1)", f"const int64_t t = INT64_C(-{2 * p + 1});") for p in PROBES]
    assert _template(sources, "s0") == "const int64_t t = ((int64_t)-(2 * n + 1));"


def rope(q, cos, sin):
    """transformers' rotary embedding on a [B, s, H, hd] projection viewed as [B, H, s, hd]."""
    q = q.transpose(1, 2)
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def norm_of_sequence_first(x, w):
    """A norm over the last axis of ``nn.MultiheadAttention``'s [s, B, D] layout, viewed as [B, s, D]."""
    y = x.transpose(0, 1)
    centred = y - y.mean(-1, keepdim=True)
    return centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + 1e-5) * w


CASES = [
    pytest.param(lambda x: (x.t() * 2).sin(), [(40, 8)], [0], id="transposed"),
    pytest.param(lambda x: x.transpose(0, 1) * 2 + 1, [(40, 4, 8)], [0], id="sequence-first"),
    pytest.param(rope, [(2, 40, 4, 16), (2, 40, 16), (2, 40, 16)], [1], id="rope"),
    # The [s, B, D] layout read as [B, s, D]: row r is (r / s, r % s), divided once a row. Refused as a
    # division per element until 2026-12-06 (a gated short convolution's silu after its transposed conv).
    pytest.param(norm_of_sequence_first, [(40, 4, 32), (32,)], [0], id="norm-of-sequence-first"),
]


@pytest.mark.parametrize("fn, shapes, dynamic", CASES)
def test_regions_whose_sizes_follow_the_length_run_for_every_length(fn, shapes, dynamic, tmp_path):
    """Runtime rows refuse each of these (the length is not only the rows); the length read at each
    call takes them, with eager's results at lengths the kernels were not written for."""
    g = torch.Generator().manual_seed(0)
    region = _region(fn, *(torch.randn(s, generator=g) for s in shapes), dynamic=tuple(dynamic))
    with pytest.raises(Unsupported):
        lower_with_runtime_rows(region)
    program = lower_with_linear_sizes(region)
    assert program.linear_sizes is not None and " n" in program.linear_sizes.template
    if fn is norm_of_sequence_first:  # the row's index divided by the length, taken since 2026-12-06
        assert "(r / (n))" in program.linear_sizes.template
    compiled = cpp_region(program, load_library(build_library(cpp_source(program), str(tmp_path))))
    assert isinstance(compiled, CppLengthRegion)
    for length in LENGTHS:
        inputs = [torch.randn([length if d in dynamic else n for d, n in enumerate(s)], generator=g)
                  if len(s) > 1 else torch.randn(s, generator=g) for s in shapes]  # fmt: skip
        (got,) = compiled(*inputs)
        want = fn(*(t.double() for t in inputs))
        assert got.shape == want.shape and got.stride() == fn(*inputs).stride(), length
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn, shapes, dynamic, reason", [
    (lambda x: x - x.mean(0, keepdim=True), [(40, 64)], (0,), "changes the kernels' code"),  # 1/s, a float
    (lambda x: x.unsqueeze(-1) * x.unsqueeze(-2), [(4, 40)], (1,), "not a whole multiple"),  # s·s
])  # fmt: skip
def test_what_depends_on_the_length_otherwise_is_refused_with_its_reason(fn, shapes, dynamic, reason):
    region = _region(fn, *(torch.randn(s) for s in shapes), dynamic=dynamic)
    with pytest.raises(Unsupported, match=reason):
        lower_with_linear_sizes(region)


def test_only_an_index_that_changes_along_the_inner_loop_divided_by_the_length_is_refused():
    """Every kernel loops over a row's columns (``c``) inside its loop over rows (``r``): a row index
    divided by the length is one division a row, hoisted out of the inner loop; a column index divided
    by it would be one an element. A divisor that is 0 at some length (``n - 3``) is refused too."""
    from accelrun.compile.codegen.linear_sizes import _refused_division

    assert not _refused_division("in1[((131 * c) + (67072 * (r / (n))) + (r % (n)))]")
    assert not _refused_division("in0[(r % (128 * n - 3))]")  # 125 and more
    assert _refused_division("in0[(r / (n - 3))]")  # 0 at length 3
    assert _refused_division("in0[(r / (2 * n - 2))]")
    assert _refused_division("in0[(c / (n))]")
    assert _refused_division("in0[((c + (512 * r)) / (2 * n + 3))]")
    assert _refused_division("in0[((r + c0) % (n))]")
    assert _refused_division("in0[(acc_min_i64(c, 5) / (n))]")  # the printer's clamps
    assert _refused_division("in0[(((2 * c) + 1) % (n))]")  # an unrolled pair's second column


def test_the_compiled_form_pickles_with_its_layouts(tmp_path):
    region = _region(rope, torch.randn(2, 40, 4, 16), torch.randn(2, 40, 16), torch.randn(2, 40, 16), dynamic=(1,))
    program = lower_with_linear_sizes(region)
    compiled = cpp_region(program, load_library(build_library(cpp_source(program), str(tmp_path))))
    loaded = pickle.loads(pickle.dumps(compiled))
    assert isinstance(loaded, CppLengthRegion)
    inputs = (torch.randn(2, 9, 4, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16))
    torch.testing.assert_close(loaded(*inputs)[0], rope(*inputs), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected"):  # the length read from q: cos of another one
        loaded(torch.randn(2, 9, 4, 16), torch.randn(2, 9, 16), torch.randn(2, 10, 16))


@pytest.mark.parametrize("name", ["mha", "encoder_causal"])
def test_attention_models_on_changing_lengths_keep_their_kernels(name, tmp_path):
    """nn.MultiheadAttention works in [s, B, D]: in the graph for any length, its regions (the
    projections' splits and norms in that layout) were ATen calls, 30 of the `mha` bench's 91 regions.
    Now they read the length at each call, at eager's losses and gradients."""
    from accelrun.compile.compile_model import compile_model
    from accelrun.config.schema import CompileConfig
    from accelrun.models.build import transformer_blocks
    from tests.compile.test_user_models import _train_side_by_side
    from tests.compile.user_models import USER_MODELS, EncoderLM

    torch.manual_seed(0)
    model = USER_MODELS["mha"]() if name == "mha" else EncoderLM(causal_hint=True)
    reference = copy.deepcopy(model)
    cfg = CompileConfig(backend="accelrun", executors=["cpp", "aten"], cache_dir=str(tmp_path / "cache"))
    record = compile_model(model, transformer_blocks(model), cfg).record
    _train_side_by_side(model, reference, steps=5, lengths=(16, 24, 40, 9, 33))
    # Two graphs read the length as a number; the third, for every further length, reads it at each
    # call: 16 (mha) and 17 (encoder) of its regions were ATen calls before, 4 and 6 once kernels
    # read the length (each dividing a row's index by it), none since a row's division is allowed.
    any_length = [r for r in record.regions if r.graph.startswith("g2.")]
    assert record.dynamo_graphs == 3 and any_length, record.compiled_line()
    left = [r.declined["cpp"] for r in any_length if r.executor != "cpp"]
    assert left == [], left
    # Since 2026-12-06 torch.nn's attention is unfolded there too (in-projection, SDPA on the mask
    # looked at when it runs, out-projection), which leaves fewer regions than its function's own
    # ops did (at least 15 before).
    assert sum(r.runtime_rows for r in any_length) >= 10, record.compiled_line()
    unfolded = {p.graph: p.counts.get("multihead") for p in record.passes if p.name == "fuse_attention"}
    layers = sum(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
    assert unfolded["g2.pre_grad"] == layers, unfolded


def test_a_kernel_that_holds_only_at_long_lengths_is_caught_when_built(tmp_path):
    """The kernels are written from three long probe lengths; a number that only holds above some
    length would pass that comparison. The compiled region is run once at short lengths against the
    region's own ops (lower._checked_at_build calls this), and such a kernel is reported there."""
    region = _region(lambda x: (x.t() * 2).sin(), torch.randn(40, 8), dynamic=(0,))
    doubled = "static_cast<float>(t2)"  # the 2 of x * 2
    right, wrong = _checked_right_and_wrong(region, doubled, f"(n < 100 ? 3.0f : {doubled})", tmp_path)
    assert right is None, right
    assert "at length 1 " in (wrong or ""), wrong


def test_a_region_that_fails_the_check_goes_to_aten_when_built_with_the_reason(tmp_path, monkeypatch):
    """Through the backend: the check runs on the build, before the region's first call and before the
    graph cache saves it, and a region that fails it runs its own ATen ops, the reason in the record;
    the others keep their kernels (the graph for any length, a frame's third)."""
    from tests.compile.test_fallbacks import _backend, _changing_sizes

    checked = []

    def planted(self, region):
        checked.append(region.id)
        return "planted: at length 1 output 0 differs" if len(checked) == 1 else None

    monkeypatch.setattr(CppLengthRegion, "differs_at_short_lengths", planted)
    torch._dynamo.reset()
    backend = _backend(tmp_path, passes="default")

    def transposed(x):
        return torch.tanh(x.t() * 2.0).t() + 1.0

    _changing_sizes(torch.compile(transposed, backend=backend), transposed, 8)
    record = backend.record
    any_length = [r for r in record.regions if r.graph.startswith("g2.")]
    assert record.dynamo_graphs == 3 and len(checked) >= 2, (record.compiled_line(), checked)
    failed = [r for r in any_length if "planted" in r.declined.get("cpp", "")]
    assert len(failed) == 1 and failed[0].executor == "aten", any_length
    assert any(r.executor == "cpp" and r.runtime_rows for r in any_length), any_length
    assert any(f.stage == "compile" and "planted" in f.reason for f in record.fallbacks), record.fallbacks
    torch._dynamo.reset()


def test_bf16_kernels_are_checked_against_the_outputs_size_not_element_by_element(tmp_path):
    """Eager rounds a bf16 product before summing it, the kernel sums in fp32 and rounds once: element
    by element the sum over the length's rows differed by 0.09 where the largest value is 18 (at
    length 7), which sent a right kernel to ATen. Against the output's largest value it passes, and a
    wrong kernel (a factor of 4 for 3 below length 100) is still caught."""
    region = _region(lambda x, y: (x.t() * y.t() * 3.0).sum(-1), torch.randn(40, 64).bfloat16(),
                     torch.randn(40, 64).bfloat16(), dynamic=(0,))  # fmt: skip
    right, wrong = _checked_right_and_wrong(region, "3.0f", "(n < 100 ? 4.0f : 3.0f)", tmp_path)
    assert right is None, right
    assert "largest difference" in (wrong or ""), wrong


def _checked_right_and_wrong(region, text: str, wrong_below_100: str, tmp_path) -> tuple[str | None, str | None]:
    """The check's verdicts on the region's kernels, and on the same kernels with ``text`` replaced by
    ``wrong_below_100`` (a number right at the long probes only)."""
    program = lower_with_linear_sizes(region)
    sizes = program.linear_sizes
    assert text in sizes.template
    verdicts = []
    for template in (sizes.template, sizes.template.replace(text, wrong_below_100)):
        changed = dataclasses.replace(program, linear_sizes=dataclasses.replace(sizes, template=template))
        compiled = cpp_region(changed, load_library(build_library(cpp_source(changed), str(tmp_path))))
        verdicts.append(compiled.differs_at_short_lengths(region))
    return verdicts[0], verdicts[1]

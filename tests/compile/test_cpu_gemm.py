"""The cpu_gemm pass and gemm_choice: fp32 CPU matrix products through oneDNN where it multiplies their
layout faster than ATen's MKL on this machine, timed on the products' own first calls and cached.

Against eager PyTorch on the same inputs, with the library forced (``library: onednn``) and tuned; the
tuner's rule on set timings; its file read by a new process's tuner, which times nothing."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

import accelrun.compile.gemm_choice as gemm_choice
from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.fast_calls import _only_reads
from accelrun.compile.gemm_choice import (
    ChangingGemmLayout,
    ChangingSizeGemmSite,
    GemmLayout,
    GemmSite,
    LayoutTuner,
    Library,
    matrix_order,
)
from accelrun.compile.options import CompileOptions
from accelrun.compile.output_code import pack_graph, unpack_graph
from accelrun.compile.passes.base import PassContext, registered_passes, resolve_passes
from accelrun.compile.passes.cpu_gemm import reinstate_sites, restore_aten_products
from accelrun.config.compile_names import PRESETS, CpuGemmOptions

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _fresh_tuners(monkeypatch):
    """Each test starts as a new process would: no tuner and no choice file read yet."""
    monkeypatch.setattr(gemm_choice, "_tuners", {})
    monkeypatch.setattr(gemm_choice, "_files", {})


def _operands(layout: GemmLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp32 ``a`` and ``b`` of ``layout`` (each row- or column-major as it says)."""
    g = torch.Generator().manual_seed(0)

    def matrix(rows: int, cols: int, col_major: bool) -> torch.Tensor:
        return torch.randn(cols, rows, generator=g).t() if col_major else torch.randn(rows, cols, generator=g)

    return matrix(layout.m, layout.k, layout.a_col_major), matrix(layout.k, layout.n, layout.b_col_major)


def _run_pass(gm: fx.GraphModule, library: str):
    return registered_passes()["cpu_gemm"].fn(gm, CpuGemmOptions(library=library), PassContext("forward"))


def _sites(gm: fx.GraphModule) -> list[GemmSite]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, GemmSite)]


def test_matrix_order():
    m = torch.randn(6, 4)
    assert matrix_order(m) is False and matrix_order(m.t()) is True
    assert matrix_order(torch.randn(6, 1)) is False
    assert matrix_order(torch.randn(6, 8)[:, :4]) is None  # gaps between rows
    assert matrix_order(torch.randn(4).expand(6, 4)) is None  # broadcast
    assert matrix_order(torch.randn(2, 3, 4)) is None


def _products(a, b, bias, w, bf16_a, bf16_b):
    return (a @ b, torch.addmm(bias, a, b), a @ w.t(), torch.addmm(bias, a, b, beta=0.5),
            bf16_a @ bf16_b)  # fmt: skip


def _inputs():
    g = torch.Generator().manual_seed(0)
    a, b, bias, w = (torch.randn(s, generator=g) for s in [(64, 48), (48, 40), (40,), (40, 48)])
    return a, b, bias, w, a.bfloat16(), b.bfloat16()


def test_forced_onednn_takes_fp32_matrix_products_with_eagers_results():
    inputs = _inputs()
    gm = make_fx(_products, tracing_mode="fake")(*inputs)
    result = _run_pass(gm, "onednn")
    # mm, addmm and the product with a transposed weight; not the scaled addmm, not the bf16 product.
    assert result.changed and result.counts == {"onednn": 3, "timed_at_first_calls": 0}
    assert [s.layout.key for s in _sites(gm)] == ["64x48x40:RR", "64x48x40:RR:bias", "64x48x40:RC"]
    assert len([n for n in gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]) == 2
    for got, expected in zip(gm(*inputs), _products(*inputs), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_aten_leaves_the_graph():
    inputs = _inputs()
    gm = make_fx(_products, tracing_mode="fake")(*inputs)
    assert not _run_pass(gm, "aten").changed and not _sites(gm)


def test_products_of_changing_sizes_choose_at_each_call_by_their_sizes_bucket(tmp_path):
    """A graph for any length: its products' sizes are symbols. Each becomes a site that reads the
    call's sizes and takes the tuner of their bucket (the changing sizes rounded up to a power of two),
    without a guard on any size."""
    x, w, bias = torch.randn(100, 48), torch.randn(40, 48), torch.randn(40)
    gm = make_fx(lambda x, w, bias: (x @ w.t(), torch.addmm(bias, x, w.t()), x.t() @ x),
                 tracing_mode="symbolic")(x, w, bias)  # fmt: skip
    shape_env = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder").shape[0].node.shape_env
    guards = len(shape_env.guards)
    result = _run_pass(gm, "tuned")
    assert result.counts == {"onednn": 0, "timed_at_first_calls": 3}
    sites = _sites(gm)
    assert all(isinstance(s, ChangingSizeGemmSite) for s in sites) and len(shape_env.guards) == guards
    assert [s.layout.key for s in sites] == ["?x?x?:RC", "?x?x?:RC:bias", "?x?x?:CR"]
    for rows in (100, 120, 200, 100):
        x = torch.randn(rows, 48)
        for got, expected in zip(gm(x, w, bias), (x @ w.t(), torch.addmm(bias, x, w.t()), x.t() @ x), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    product = sites[0]
    assert product._tuners[(100, 48, 40)] is product._tuners[(120, 48, 40)]  # one bucket: 128 rows
    assert sorted(t.layout.key for t in {id(t): t for t in product._tuners.values()}.values()) == \
        ["128x64x64:RC:bucket", "256x64x64:RC:bucket"]  # fmt: skip
    empty = product(torch.randn(0, 48), w.t())
    assert empty.shape == (0, 40) and (0, 48, 40) not in product._tuners


def test_a_changing_size_product_with_nothing_to_sum_is_atens_even_where_onednn_is_forced():
    """An expert that met no tokens: its weight gradient ``x.t() @ grad`` sums over 0 rows, which
    oneDNN's linear layer refuses; ATen's gives zeros."""
    gm = make_fx(lambda x, g: x.t() @ g, tracing_mode="symbolic")(torch.randn(100, 48), torch.randn(100, 40))
    _run_pass(gm, "onednn")
    assert len(_sites(gm)) == 1
    assert torch.equal(gm(torch.randn(0, 48), torch.randn(0, 40)), torch.zeros(48, 40))


def _counting_libraries(monkeypatch) -> dict[Library, int]:
    calls = {Library.ATEN: 0, Library.ONEDNN: 0}

    def counted(lib, real):
        def call(a, b, bias=None):
            calls[lib] += 1
            return real(a, b, bias)
        return call

    monkeypatch.setattr(gemm_choice, "MULTIPLY", {lib: counted(lib, f) for lib, f in gemm_choice.MULTIPLY.items()})
    monkeypatch.setattr(gemm_choice, "_aten_mm", counted(Library.ATEN, gemm_choice._aten_mm))
    return calls


def test_an_experts_products_meeting_a_new_size_at_every_call_run_aten(tmp_path, monkeypatch):
    """oneDNN builds a kernel at each new size: chosen for a bucket on repeated sizes, it stays where
    sizes come back (lengths in turn) and gives way to ATen where they do not (an expert's token counts),
    with ATen's results either way."""
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(tmp_path))
    layout = ChangingGemmLayout((None, 48, 40), False, False, False)
    w = torch.randn(48, 40)
    for buckets in (64, 128):  # oneDNN already chosen for the buckets these calls fall in
        gemm_choice.tuner_for(layout.at(buckets, 48, 40)).library = Library.ONEDNN
    lengths, tokens = ChangingSizeGemmSite(layout), ChangingSizeGemmSite(layout)
    calls = _counting_libraries(monkeypatch)
    for i in range(64):
        x = torch.randn((96, 100, 110, 120, 70, 80)[i % 6], 48)
        torch.testing.assert_close(lengths(x, w), x @ w, rtol=1e-5, atol=1e-5)
    # six lengths in turn: new at calls 1-6, so more than half new at calls 8 to 11 only
    assert calls == {Library.ATEN: 4, Library.ONEDNN: 60}, calls
    calls.update({Library.ATEN: 0, Library.ONEDNN: 0})
    found = []  # a size's tuner is looked up only while the site may use it (0.1 ms a call, at every call)
    monkeypatch.setattr(gemm_choice, "tuner_for", lambda layout, find=gemm_choice.tuner_for: found.append(layout)
                        or find(layout))  # fmt: skip
    for rows in [*range(65, 75), 65, *range(75, 128)]:  # a new count at every call but one
        x = torch.randn(rows, 48)
        torch.testing.assert_close(tokens(x, w), x @ w, rtol=1e-5, atol=1e-5)
    assert calls == {Library.ATEN: 64 - 7, Library.ONEDNN: 7}, calls  # from the 8th call on
    assert len(found) == 7, len(found)
    assert tokens.sizes_rarely_repeat() and not lengths.sizes_rarely_repeat()


def test_a_site_meeting_new_sizes_stops_timing_its_undecided_bucket(tmp_path, monkeypatch):
    """Undecided, a bucket alternates the libraries on its calls and times only those at sizes met
    before: where sizes never repeat it never decided, and oneDNN built a kernel on every other call.
    From the 8th call of new sizes on, the site runs ATen and times nothing."""
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(tmp_path))
    site = ChangingSizeGemmSite(ChangingGemmLayout((None, 48, 40), False, False, False))
    calls = _counting_libraries(monkeypatch)
    w = torch.randn(48, 40)
    sizes: list[int] = []
    for i in range(60):  # every third call at the size before it: two in three new
        sizes.append(sizes[-1] if i % 3 == 2 else 65 + i)
    for rows in sizes:
        x = torch.randn(rows, 48)
        torch.testing.assert_close(site(x, w), x @ w, rtol=1e-5, atol=1e-5)
    tuner = gemm_choice.tuner_for(site.layout.at(65, 48, 40))
    assert tuner.library is None and sum(map(len, tuner.times.values())) <= 2, tuner.times  # timed no further
    assert calls[Library.ONEDNN] <= 4 and calls[Library.ATEN] >= 56, calls  # of the first 7 calls, some oneDNN


def test_a_bucket_times_each_call_per_multiply_add(tmp_path, monkeypatch):
    """Calls of one bucket have other sizes: each is timed as if it had the bucket's multiply-adds, so
    a library is not judged on the smaller calls it happened to get."""
    layout = GemmLayout(128, 48, 40, False, False, False)  # (a fixed layout: every call timed)
    tuner = LayoutTuner(layout, gemm_choice.ChoiceFile(tmp_path / "c.json"), None)
    clock = iter([0.0, 1.0, 0.0, 1.0])  # each call takes one second
    monkeypatch.setattr(gemm_choice.time, "perf_counter", lambda: next(clock))
    tuner.timed_call(torch.randn(128, 48), torch.randn(48, 40), None)
    tuner.timed_call(torch.randn(64, 48), torch.randn(48, 40), None)
    assert tuner.times == {Library.ATEN: [1.0], Library.ONEDNN: [2.0]}


def test_a_buckets_first_call_at_each_size_is_not_timed(tmp_path, monkeypatch):
    """oneDNN builds a kernel for each new size: in a bucket, whose calls come in several sizes, each
    library's first call at a size would carry that build into its timings."""
    layout = GemmLayout(128, 48, 40, False, False, False, bucket=True)
    tuner = LayoutTuner(layout, gemm_choice.ChoiceFile(tmp_path / "c.json"), None)
    monkeypatch.setattr(gemm_choice.time, "perf_counter", iter([0.0, 1.0] * 8).__next__)
    b = torch.randn(48, 40)
    for rows in (128, 128, 128, 64, 64, 64):
        tuner.timed_call(torch.randn(rows, 48), b, None)
    # At 128: ATen (its first there: untimed), ATen (timed), oneDNN (its first: untimed); at 64:
    # oneDNN (its first there: untimed), oneDNN (timed, per multiply-add), then oneDNN again (it goes
    # first in every other pair). A fixed layout would have timed all six.
    assert tuner.times == {Library.ATEN: [1.0], Library.ONEDNN: [2.0, 2.0]}


def test_the_tuner_times_both_libraries_in_turns_and_keeps_onednn_only_by_the_margin(tmp_path):
    layout = GemmLayout(64, 48, 40, False, False, False)
    file = gemm_choice.ChoiceFile(tmp_path / "choices.json")
    a, b = _operands(layout)
    tuner = gemm_choice._tuners[(file.path, layout.key)] = LayoutTuner(layout, file, None)
    calls = 2 * (gemm_choice.UNTIMED_CALLS + gemm_choice.TIMED_CALLS)
    for i in range(calls):
        assert tuner.library is None, f"decided after {i} calls"
        assert gemm_choice.undecided_layouts() == [layout.key]
        torch.testing.assert_close(tuner.timed_call(a, b, None), a @ b, rtol=1e-5, atol=1e-5)
    assert tuner.library in (Library.ATEN, Library.ONEDNN)
    assert gemm_choice.undecided_layouts() == []
    saved = json.loads(file.path.read_text())["choices"][layout.key]
    assert saved["library"] == tuner.library.value and saved["aten_us"] > 0 and saved["onednn_us"] > 0

    def decided(aten_s: float, onednn_s: float) -> Library:
        t = LayoutTuner(layout, file, None)
        t.times = {Library.ATEN: [1.0] + [aten_s] * 4, Library.ONEDNN: [1.0] + [onednn_s] * 4}
        t._decide()
        return t.library

    assert decided(1.0, 0.9) is Library.ONEDNN
    assert decided(1.0, 0.99) is Library.ATEN  # within the margin: ATen stays
    assert decided(0.9, 1.0) is Library.ATEN


def test_which_library_goes_first_alternates(tmp_path):
    """A layout's sites in one step read the same input, and the first reads it from memory: the two
    libraries take the first place in turns."""
    layout = GemmLayout(64, 48, 40, False, False, False)
    a, b = _operands(layout)
    tuner = LayoutTuner(layout, gemm_choice.ChoiceFile(tmp_path / "c.json"), None)
    order = []
    for _ in range(4):
        before = {lib: len(t) for lib, t in tuner.times.items()}
        tuner.timed_call(a, b, None)
        order.append(next(lib for lib, t in tuner.times.items() if len(t) > before[lib]))
    assert order == [Library.ATEN, Library.ONEDNN, Library.ONEDNN, Library.ATEN]


class UsersMLP(nn.Module):
    """Written the way users write one: torch.nn's Linear layers, with and without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64, bias=False)
        self.head = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(torch.relu(self.up(x))))


def _train(model: nn.Module, fn, steps: int, rows: tuple[int, ...] | None = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(256 if rows is None else rows[step], 64, generator=g)
        loss = fn(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _backend(library: str) -> AccelrunBackend:
    passes = [p if p != "cpu_gemm" else {"cpu_gemm": {"library": library}} for p in PRESETS["default"]]
    return AccelrunBackend(CompileOptions(passes=resolve_passes(passes), executors=["cpp", "aten"], strict=True))


def _fired(backend: AccelrunBackend) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in backend.record.passes:
        if p.name == "cpu_gemm":
            for k, v in p.counts.items():
                counts[k] = counts.get(k, 0) + v
    return counts


@pytest.mark.parametrize("library", ["onednn", "tuned"])
def test_a_users_mlp_trains_at_eagers_losses(library):
    torch.manual_seed(0)
    model = UsersMLP()
    twin = UsersMLP()
    twin.load_state_dict(model.state_dict())
    backend = _backend(library)
    steps = 12  # tuned: each layout's first calls alternate; 10 decide one that runs once a step
    compiled = _train(model, torch.compile(model, backend=backend), steps)
    torch.testing.assert_close(compiled, _train(twin, twin, steps), rtol=1e-5, atol=1e-6)
    fired = _fired(backend)
    # Forward: three products; backward: input and weight gradients of each (the first layer's input
    # gradient is not needed): eight, every one fp32 on matrices.
    assert fired.get("onednn", 0) + fired.get("timed_at_first_calls", 0) == 3 + 5
    if library == "tuned":
        tuners = list(gemm_choice._tuners.values())
        assert tuners and all(t.library is not None for t in tuners), "every layout decided"
        choices = json.loads(tuners[0].file.path.read_text())["choices"]
        assert set(choices) == {t.layout.key for t in tuners}


def test_a_new_process_reads_the_choices_and_times_nothing():
    torch.manual_seed(0)
    model = UsersMLP()
    _train(model, torch.compile(model, backend=_backend("tuned")), 12)
    decided = {t.layout.key: t.library for t in gemm_choice._tuners.values()}
    gemm_choice._tuners.clear()
    gemm_choice._files.clear()  # as a new process
    torch._dynamo.reset()
    backend = _backend("tuned")
    _train(model, torch.compile(model, backend=backend), 1)
    fired = _fired(backend)
    assert fired.get("timed_at_first_calls", 0) == 0
    # Each layout oneDNN won has at least one product on it, now without timing; ATen's keep their op.
    assert fired.get("onednn", 0) >= sum(1 for lib in decided.values() if lib is Library.ONEDNN)
    assert all(t.library is decided[t.layout.key] and not any(t.times.values()) for t in gemm_choice._tuners.values())


def test_a_site_survives_the_graph_cache_and_reads_only():
    inputs = _inputs()
    gm = make_fx(lambda a, b: a @ b, tracing_mode="fake")(*inputs[:2])
    _run_pass(gm, "onednn")
    (site,) = _sites(gm)
    loaded = unpack_graph(pack_graph(gm))
    (copy,) = [n.target for n in loaded.graph.nodes if n.op == "call_function"]
    assert isinstance(copy, GemmSite) and copy.layout == site.layout and copy.fixed is Library.ONEDNN
    torch.testing.assert_close(loaded(*inputs[:2]), inputs[0] @ inputs[1], rtol=1e-5, atol=1e-5)
    tuned = pickle.loads(pickle.dumps(GemmSite(site.layout)))
    assert tuned.tuner is gemm_choice.tuner_for(site.layout)  # the process's one tuner of the layout
    user = next(n for n in gm.graph.nodes if isinstance(n.target, GemmSite))
    assert _only_reads(user)


def test_batches_of_changing_rows_train_at_eagers_losses_through_sites_that_choose_per_size():
    """A user's MLP fed batches of another size each step: after the first size, one graph for every
    size whose products are sites choosing by each call's sizes (no guard, no third graph), at eager's
    losses. Until 2026-12-05 such a graph left every product to ATen's MKL."""
    torch.manual_seed(0)
    model, twin = UsersMLP(), UsersMLP()
    twin.load_state_dict(model.state_dict())
    backend = _backend("tuned")
    rows = (256, 192, 320, 96, 192, 256, 130, 320, 96, 96, 192, 320, 256)  # enough calls to decide buckets
    compiled = _train(model, torch.compile(model, backend=backend), len(rows), rows)
    torch.testing.assert_close(compiled, _train(twin, twin, len(rows), rows), rtol=1e-5, atol=1e-6)
    assert backend.record.dynamo_graphs == 2, backend.record.compiled_line()
    changing = [p for p in backend.record.passes if p.name == "cpu_gemm" and p.graph.startswith("g1.")]
    assert sum(p.counts.get("timed_at_first_calls", 0) for p in changing) == 3 + 5, changing
    buckets = {t.layout.m for t in gemm_choice._tuners.values()} | {t.layout.k for t in gemm_choice._tuners.values()}
    assert {128, 256, 512} <= buckets, buckets  # 96; 130, 192 and 256; 320 rows


def test_a_changing_size_site_survives_the_graph_cache():
    x, w = torch.randn(100, 48), torch.randn(48, 40)
    gm = make_fx(lambda x, w: x @ w, tracing_mode="symbolic")(x, w)
    _run_pass(gm, "onednn")
    (site,) = _sites(gm)
    loaded = unpack_graph(pack_graph(gm))
    (copy,) = [n.target for n in loaded.graph.nodes if n.op == "call_function" and isinstance(n.target, GemmSite)]
    assert type(copy) is ChangingSizeGemmSite and copy.layout == site.layout and copy.fixed is Library.ONEDNN
    assert isinstance(copy.layout, ChangingGemmLayout)
    restore_aten_products(gm)
    assert not _sites(gm)
    reinstate_sites(gm)
    (again,) = _sites(gm)
    assert type(again) is ChangingSizeGemmSite and again.layout == site.layout
    x = torch.randn(70, 48)
    torch.testing.assert_close(loaded(x, w), x @ w, rtol=1e-5, atol=1e-5)

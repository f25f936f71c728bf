"""accelrun's Triton code generator against eager PyTorch, run by Triton's interpreter on the CPU.

The interpreter is slow, so these are a few representative regions (row reductions, a column
reduction, broadcasts and views, bf16), not the property tests of test_codegen_cpp.py. triton reads
TRITON_INTERPRET when a kernel is decorated, i.e. when the generated module is imported, so setting
it before ``compile`` is enough. Tolerances: fp32 rtol 1e-5, atol 1e-5 (reductions); bf16 rtol 1e-2.

With ACCELRUN_TRITON_TEST_DEVICE=cuda (bench/gpu_smoke.sh) the same regions are traced on CUDA tensors
and run by Triton's real compiler on the GPU, without the interpreter.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch._functorch.aot_autograd import aot_function, make_boxed_func

from accelrun.compile.codegen import triton as triton_codegen
from accelrun.compile.codegen.loop_ir import Block, Kernel, Reduction, cached_program
from accelrun.compile.codegen.triton import cols_split, launches
from accelrun.compile.codegen.triton_region import TritonRegion
from accelrun.compile.executors.triton import TritonExecutor
from accelrun.compile.passes.partition_regions import partition
from accelrun.compile.regions import Region
from tests.compile.traced_regions import regions_of as traced_regions

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

DEVICE = os.environ.get("ACCELRUN_TRITON_TEST_DEVICE", "cpu")
if DEVICE != "cpu" and not torch.cuda.is_available():
    pytestmark = [pytestmark, pytest.mark.skip(reason=f"ACCELRUN_TRITON_TEST_DEVICE={DEVICE} but no CUDA device")]


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels run by the interpreter on the CPU; on the GPU when DEVICE is cuda."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def regions_of(fn, *args, device: str = DEVICE) -> list[Region]:
    """Regions the partitioner cuts from the forward and backward graphs of ``fn`` (on ``device``)."""
    return traced_regions(fn, *args, device=device)


def check(region: Region, cache: str) -> None:
    ex = TritonExecutor()
    assert ex.unavailable_reason() is None
    reason = ex.decline_reason(region)
    assert reason is None, reason
    fn = ex.compile(region, cache)
    gen = torch.Generator().manual_seed(region.id)
    # On a GPU a second call, on other values: from it on the region launches its compiled kernels
    # directly (TritonRegion._compiled), not through triton.jit.
    for call in range(1 if DEVICE == "cpu" else 2):
        inputs = []
        for m in region.input_meta:
            # The input's storage filled, then viewed at its strides (an expanded input's are 0).
            size = 1 + sum((n - 1) * st for n, st in zip(m.shape, m.stride(), strict=True)) if m.numel() else 0
            base = (torch.randn(size, generator=gen) if m.dtype.is_floating_point
                    else torch.randint(0, 4, (size,), generator=gen)).to(dtype=m.dtype, device=m.device)
            inputs.append(base.as_strided(tuple(m.shape), tuple(m.stride())))
        for got, want in zip(fn(*inputs), region.gm(*inputs), strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype
            tol = dict(rtol=1e-2, atol=1e-2) if want.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got, want, equal_nan=True, **tol)
        if call == 1:
            kernels = getattr(fn, "fn", fn)  # under with_output_strides' wrapper
            assert kernels._compiled is not None, "the second call did not launch directly"


def rmsnorm(x, w):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * w


def rope(x, cos, sin):
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).type_as(x)


CASES = {
    # forward: row reduction + epilogue; backward: a row and a column reduction
    "rmsnorm_fp32": lambda: (rmsnorm, torch.randn(2, 4, 24, requires_grad=True), torch.randn(24, requires_grad=True)),
    "rmsnorm_bf16": lambda: (rmsnorm, torch.randn(2, 4, 24, dtype=torch.bfloat16, requires_grad=True),
                             torch.randn(24, dtype=torch.bfloat16, requires_grad=True)),
    "cross_entropy": lambda: (lambda lg, t: F.cross_entropy(lg, t), torch.randn(6, 40, requires_grad=True),
                              torch.randint(0, 40, (6,))),
    # the backward: one region, a column loop (weight gradient) and a row loop (input gradient)
    "rmsnorm_sin_one_region": lambda: (lambda x, w: rmsnorm(x, w).sin(), torch.randn(2, 4, 24, requires_grad=True),
                                       torch.randn(24, requires_grad=True)),
    # one max and one sum for both; exp kept from the sum's pass for softmax's epilogue
    "softmax_log_softmax": lambda: (lambda x: torch.softmax(x, -1) + torch.log_softmax(x, -1),
                                    torch.randn(5, 24, requires_grad=True)),
    # exp kept in a row buffer by the sum's pass for the division's (recomputed when rows are looped)
    "exp_normalised": lambda: (lambda x: (x - x.amax(-1, keepdim=True)).exp().div((x - x.amax(-1, keepdim=True))
                                                                                 .exp().sum(-1, keepdim=True)),
                               torch.randn(5, 40, requires_grad=True)),
    # logsumexp (decomposed: max, infinities replaced by 0, sum of exp, log, add), and a max beside it
    "logsumexp": lambda: (lambda x: torch.logsumexp(x, -1) + x.amax(-1) * x.sum(-1), torch.randn(6, 40, requires_grad=True)),
    # column reductions cut into row chunks (two stages: partials, then the final kernel)
    "rmsnorm_split_cols": lambda: (rmsnorm, torch.randn(4, 32, 72, requires_grad=True),
                                   torch.randn(72, requires_grad=True)),
    "amax_split_cols": lambda: (lambda x, b: x.amax(0) * b.sum(0), torch.randn(200, 40, requires_grad=True),
                                torch.randn(200, 40, requires_grad=True)),
    # a short middle-axis sum (GQA's key/value gradient), unrolled into adds of slices
    "gqa_sum": lambda: (lambda g: g.view(2, 2, 3, 16, 8).sum(2).exp(), torch.randn(2, 6, 16, 8, requires_grad=True)),
    # GQA's key gradient summed over its 3 query heads, RoPE, and a cat of parts long enough to be
    # stored part by part, each loop inside one head of 32 (the last axis split where loads jump)
    "gqa_rope_cat": lambda: (lambda q, k, c, s: torch.cat([rope(q, c, s).flatten(2),
                                                           rope(k.unflatten(2, (2, 3)).sum(3), c, s).flatten(2)], -1),
                             torch.randn(2, 4, 6, 32, requires_grad=True), torch.randn(2, 4, 6, 32, requires_grad=True),
                             torch.randn(4, 16), torch.randn(4, 16)),
    "rope_swiglu": lambda: (lambda x, c, s: F.silu(rope(x, c, s)) * x, torch.randn(2, 4, 2, 8, requires_grad=True),
                            torch.randn(4, 4), torch.randn(4, 4)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_regions_under_the_interpreter(interpret, tmp_path, name):
    fn, *args = CASES[name]()
    regions = regions_of(fn, *args)
    assert regions
    for region in regions:
        check(region, str(tmp_path))
        assert "@triton.jit" in region.lowering.sources["triton"].text and region.lowering.sources["triton"].ext == "py"


def test_unavailable_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present, so triton is available without the interpreter")
    # said in every region left to ATen on a CPU: short, and no offer of the interpreter (for tests only)
    assert TritonExecutor().unavailable_reason() == "no CUDA device"


ROW_CASES = ["rmsnorm_fp32", "rmsnorm_bf16", "cross_entropy", "rmsnorm_sin_one_region", "softmax_log_softmax",
             "exp_normalised", "logsumexp"]


@pytest.mark.parametrize("name", ROW_CASES)
def test_row_reductions_in_a_loop_under_the_interpreter(interpret, tmp_path, monkeypatch, name):
    """Every row reduction walked in chunks of 16 columns (rows of 24 and 40: a partial last chunk),
    as rows longer than MAX_ROW are; softmax's exp, kept in a row buffer by the loop IR, recomputed."""
    monkeypatch.setattr(triton_codegen, "MAX_ROW", 16)
    monkeypatch.setattr(triton_codegen, "LOOP_BLOCK_N", 16)
    fn, *args = CASES[name]()
    regions = regions_of(fn, *args)
    looped = [r for r in regions if any(triton_codegen.looped(k) for k in cached_program(r).kernels)]
    assert looped, "no region has a row reduction"
    for region in regions:
        check(region, str(tmp_path))
    assert all("for c0 in range(0, " in r.lowering.sources["triton"].text for r in looped)
    if name == "exp_normalised":  # the row buffer's value is recomputed, not read from a variable
        assert any(k.row_buffers for r in looped for k in cached_program(r).kernels)
    if name in ("exp_normalised", "logsumexp"):  # max and sum of exp in one loop (online)
        assert any(triton_codegen.online_pairs(k) for r in looped for k in cached_program(r).kernels)
        assert any("_shift = " in r.lowering.sources["triton"].text for r in looped)


@pytest.mark.parametrize("fn", [torch.logsumexp, lambda x, d: torch.exp(x - x.amax(d, keepdim=True)).sum(d),
                                lambda x, d: CASES["exp_normalised"]()[0](x)],
                         ids=["logsumexp", "sum_exp", "softmax"])  # fmt: skip
def test_online_sum_of_exponentials_with_infinities(interpret, tmp_path, monkeypatch, fn):
    """The running max starts at -inf in every lane, meets -inf entries (masked logits), whole rows
    of -inf, +inf and NaN: the rescaled sum gives eager's results there too (NaN where eager's is)."""
    monkeypatch.setattr(triton_codegen, "MAX_ROW", 16)
    monkeypatch.setattr(triton_codegen, "LOOP_BLOCK_N", 16)
    x = torch.randn(6, 40) * 30
    x[0, 5:] = float("-inf")  # later lanes meet only -inf
    x[1, :30] = float("-inf")  # lanes start at -inf, then a finite max
    x[2] = float("-inf")
    x[3, 7] = float("inf")
    x[4, 33] = float("nan")
    x[5, ::3] = -1000.0  # a lane's first max far below the row's
    (region,) = [r for r in regions_of(lambda a: fn(a, -1), x.requires_grad_()) if r.graph_kind == "forward"]
    assert any(triton_codegen.online_pairs(k) for k in cached_program(region).kernels)
    ex = TritonExecutor()
    run = ex.compile(region, str(tmp_path))
    # The forward's inputs: x, and logsumexp's 0 (what replaces an infinite max), a lifted constant.
    inputs = [x.detach() if tuple(m.shape) == tuple(x.shape) else torch.zeros((), dtype=m.dtype)
              for m in region.input_meta]  # fmt: skip
    inputs = [t.to(DEVICE) for t in inputs]
    got, want = run(*inputs), region.gm(*inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


VOCAB = 128256  # Llama 3's vocabulary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_wide_softmax_and_cross_entropy_in_triton(interpret, tmp_path, dtype):
    """Rows of a 128K vocabulary are claimed (not declined to ATen) and match eager: softmax's and
    cross-entropy's regions, forward and backward, 3 rows."""
    for fn, *args in [(lambda x: torch.softmax(x, -1) * 2, torch.randn(3, VOCAB, dtype=dtype, requires_grad=True)),
                      (lambda lg, t: F.cross_entropy(lg.float(), t), torch.randn(3, VOCAB, dtype=dtype,
                                                                                requires_grad=True),
                       torch.randint(0, VOCAB, (3,)))]:
        regions = regions_of(fn, *args)
        wide = [r for r in regions if any(k.cols == VOCAB and triton_codegen.looped(k)
                                          for k in cached_program(r).kernels)]
        assert wide
        for region in regions:
            check(region, str(tmp_path))


def test_grids_stay_within_cuda_limits():
    """Tiles are numbered along grid axis 0 (limit 2**31 - 1), never 65,535 column blocks on axis 1:
    a 1-d tensor of 2**27 elements, 2**17 rows of a norm, a column reduction over 2**20 rows."""
    pointwise = Kernel("kernel0", "rows", (), (2**27,))
    assert triton_codegen.grid(pointwise) == (2**27 // 1024,)
    rows = Kernel("kernel0", "rows", (2**17,), (4096,), blocks=[Block("inner", reductions=[Reduction("a", "sum", "x",
                                                                                                    "f32")])])
    assert triton_codegen.grid(rows) == (2**17,) and triton_codegen.tiles(rows) == (1, 4096)
    wide = Kernel("kernel0", "rows", (70000,), (VOCAB,), blocks=rows.blocks)
    assert triton_codegen.grid(wide) == (70000,) and triton_codegen.tiles(wide) == (1, triton_codegen.LOOP_BLOCK_N)
    cols = triton_codegen.grid(Kernel("kernel0", "cols", (2**20,), (4096,)))
    assert all(n <= limit for n, limit in zip(cols, (2**31 - 1, 65535), strict=False))
    for g in (triton_codegen.grid(pointwise), triton_codegen.grid(rows), triton_codegen.grid(wide), cols):
        assert len(g) <= 2 and all(n <= 65535 for n in g[1:])


def test_pointwise_tiles_on_one_grid_axis_under_the_interpreter(interpret, tmp_path, monkeypatch):
    """Rows and column blocks numbered together on axis 0: 3 x 5 tiles of a (10, 80) pointwise region."""
    monkeypatch.setattr(triton_codegen, "TILE_ELEMENTS", 64)
    (region,) = [r for r in regions_of(lambda x: (x * 2).exp(), torch.randn(10, 80, requires_grad=True))
                 if r.graph_kind == "forward"]
    check(region, str(tmp_path))
    (ln,) = launches(cached_program(region))
    assert ln.grid == (-(-10 // ln.block_r) * -(-80 // ln.block_n),) and ln.grid[0] > 1


def test_column_reduction_of_a_norm_weight_gradient_is_split():
    """(8192, 1024) summed over rows: many programs over row chunks, not one program per column block."""
    split = cols_split(Kernel("kernel0", "cols", (8, 1024), (1024,)))
    assert split.col_blocks * split.chunks >= 256
    assert split.chunks * split.rows_per_chunk >= 8192 > (split.chunks - 1) * split.rows_per_chunk
    small = cols_split(Kernel("kernel0", "cols", (8,), (24,)))
    assert small.chunks == 1 and small.rows_per_chunk >= 8


def test_compiled_region_launches_a_split_reduction_in_two_kernels(interpret, tmp_path):
    fn, *args = CASES["rmsnorm_split_cols"]()
    cols = [r for r in regions_of(fn, *args) if any(k.kind == "cols" for k in cached_program(r).kernels)]
    assert cols
    source = TritonExecutor().source(cols[0])
    names = [ln.kernel for ln in launches(cached_program(cols[0]))]
    assert len(names) == 2 and names[1] == names[0] + "_final"
    assert f"def {names[1]}(" in source and "tl.program_id(1) * 64" in source


def _lowered(fn, *args, executors, tmp_path):
    """The forward graph of ``fn`` partitioned and lowered as the backend does, and its record."""
    from accelrun.compile.lower import lower_regions
    from accelrun.compile.record import CompileRecord

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    aot_function(fn, fw_compiler=keep, bw_compiler=keep, decompositions=core_aten_decompositions())(*args)
    partition(graphs[0].graph, first_id=0)
    record = CompileRecord()
    lowered, regions = lower_regions(graphs[0], "g0.forward", "forward", executors, record, str(tmp_path))
    return lowered, regions, record


def test_a_kernel_the_gpu_cannot_take_goes_to_the_next_executor(monkeypatch, tmp_path):
    """Off the interpreter, the executor compiles and loads every kernel while the region is lowered
    (triton_aot.warm_up), so what Triton raises there (here: OutOfResources, as loading a kernel that
    needs more shared memory than the GPU has raises it) is a recorded fallback, not step 1's crash.
    The GPU is stood in for: the executor is told it is available and takes CPU tensors."""
    from triton.runtime.errors import OutOfResources

    from accelrun.compile.codegen import triton_aot
    from accelrun.compile.executors.aten import AtenExecutor

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(TritonExecutor, "unavailable_reason", lambda self: None)
    monkeypatch.setattr(TritonExecutor, "runs_anywhere", lambda self: True)
    warmed = []

    def refuse(program, module, plan=None):
        warmed.append(module)
        raise OutOfResources(264192, 232448, "shared memory")

    monkeypatch.setattr(triton_aot, "warm_up", refuse)
    x, w = torch.randn(2, 4, 24), torch.randn(24)
    lowered, regions, record = _lowered(rmsnorm, x, w, executors=[TritonExecutor(), AtenExecutor()],
                                        tmp_path=tmp_path)  # fmt: skip
    assert warmed, "the executor compiled the kernels before the first call"
    assert regions and all(r.lowering.executor == "aten" for r in regions)
    assert any(f.stage == "compile" and "OutOfResources" in f.reason for f in record.fallbacks)
    torch.testing.assert_close(lowered(x, w)[0], rmsnorm(x, w))


def test_a_first_call_failure_of_a_triton_region_goes_to_the_next_executor(interpret, monkeypatch, tmp_path):
    """A launch that raises at the first call (a stand-in for a launch the driver refuses) is caught by
    the lowering's first-call check: the region runs as ATen ops, and the record says why."""
    from accelrun.compile.executors.aten import AtenExecutor

    def refuse(self, *args):
        raise RuntimeError("Triton Error [CUDA]: invalid argument")

    monkeypatch.setattr(TritonRegion, "__call__", refuse)
    x, w = torch.randn(2, 4, 24, device=DEVICE), torch.randn(24, device=DEVICE)
    lowered, regions, record = _lowered(rmsnorm, x, w, executors=[TritonExecutor(), AtenExecutor()],
                                        tmp_path=tmp_path)  # fmt: skip
    assert regions and regions[0].lowering.executor == "triton"
    torch.testing.assert_close(lowered(x, w)[0], rmsnorm(x, w))
    assert any(f.stage == "first call" and "invalid argument" in f.reason for f in record.fallbacks)


@pytest.mark.parametrize("head_dim", [24, 4096], ids=["12_pairs_partial_tile", "2048_pairs_two_column_blocks"])
def test_interleaved_pairs_load_and_store_contiguously(interpret, tmp_path, head_dim):
    """RoPE on (even, odd) pairs reads x[2c] and x[2c + 1]: the kernel loads the row's 2 * BLOCK_N
    elements at once and splits them (and joins before one store), instead of two stride-2 accesses,
    which ran 10x slower on an H100. Checked where the pairs do not fill the tile (12 of 16) and where
    a row takes two column blocks (2048 pairs, BLOCK_N 1024)."""
    x = torch.randn(1, 2, 1, head_dim, requires_grad=True)
    cos, sin = torch.randn(2, head_dim // 2), torch.randn(2, head_dim // 2)
    # x * 2 inside the region: its pairs are read from one buffer (a region input sliced by the
    # graph would arrive as two buffers, which no load can pair)
    regions = regions_of(lambda x, c, s: rope(x * 2, c, s), x, cos, sin)
    assert regions
    for region in regions:
        check(region, str(tmp_path))
        src = region.lowering.sources["triton"].text
        assert "tl.join(" in src  # the output's pairs: one store
        if region.graph_kind == "forward":  # x * 2's pairs: one load (the backward's gradient comes as two slices)
            assert "tl.split(tl.reshape(" in src and "(2 * c)" not in src
    if head_dim == 4096:
        assert any(blocks[1] > 1 for r in regions for k in cached_program(r).kernels
                   if (blocks := triton_codegen.blocks_per_axis(k)))


def test_a_compiled_triton_region_pickles_by_its_module_file(interpret, tmp_path):
    """The graph cache saves lowered graphs with their regions pickled: a Triton region comes back from
    its generated module's file and its program (not lowered again in the next process), and a file
    gone from the cache is an error the graph cache answers by compiling afresh."""
    import pickle


    fn, *args = CASES["rmsnorm_fp32"]()
    region = regions_of(fn, *args)[0]
    compiled = TritonExecutor().compile(region, str(tmp_path))
    inner = getattr(compiled, "fn", compiled)
    assert isinstance(inner, TritonRegion)
    back = pickle.loads(pickle.dumps(compiled))
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(tuple(m.shape), generator=gen).to(m.dtype).to(DEVICE) for m in region.input_meta]
    for got, want in zip(back(*inputs), compiled(*inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    data = pickle.dumps(compiled)
    os.remove(inner.module_file)
    with pytest.raises(FileNotFoundError, match="is not in the kernel cache"):
        pickle.loads(data)

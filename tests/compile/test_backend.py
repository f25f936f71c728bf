"""The accelrun backend end to end: capture, passes, regions, executors, debug numerics, recipes, explain."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner

import accelrun.compile.passes.cpu_half_gemm as cpu_half_gemm
from accelrun.cli.main import cli
from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.numerics import PassNumericsError
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import PassOptions, PassResult, register_pass, resolve_passes
from accelrun.config import load_config
from accelrun.models.families.llama.model import LlamaArgs, TransformerBlock, rope_tables
from accelrun.report.metrics import read_metrics
from accelrun.train.entry import train
from tests.conftest import DEFAULT_CONFIG

ARGS = LlamaArgs(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64)
T = 16


def _blocks_and_reference(n: int = 2):
    torch.manual_seed(0)
    blocks = [TransformerBlock(ARGS) for _ in range(n)]
    return blocks, copy.deepcopy(blocks)


def _run(blocks, x, cos, sin):
    h = x
    for b in blocks:
        h = b(h, cos, sin)
    h.square().mean().backward()
    return h.detach(), [p.grad for b in blocks for p in b.parameters()], x.grad


def _assert_same_step(compiled, reference, rtol=1e-5, atol=1e-6):
    cos, sin = rope_tables(ARGS.head_dim, T, ARGS.rope_theta)
    x = torch.randn(2, T, ARGS.dim, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    h, grads, dx = _run(compiled, x, cos, sin)
    h_ref, grads_ref, dx_ref = _run(reference, x_ref, cos, sin)
    torch.testing.assert_close(h, h_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx, dx_ref, rtol=rtol, atol=atol)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("passes", ["none", ["dce", "cse", "partition_regions"], "default", "max"])
def test_llama_blocks_match_eager_fp32(passes, tmp_path):
    blocks, reference = _blocks_and_reference()
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(passes), executors=["aten"],
                                             dump_dir=tmp_path / "dump", debug_numerics=True))  # fmt: skip
    for b in blocks:
        b.compile(backend=backend)
    _assert_same_step(blocks, reference)
    # Both blocks share the graph: one Dynamo graph for two blocks of the same code.
    assert backend.record.dynamo_graphs == 1
    assert list((tmp_path / "dump" / "g0.forward").glob("*_input.py"))
    if passes not in ("none",):
        assert backend.record.passes, "the passes ran and were recorded"
    if passes in ("default", "max"):  # the joint graph's and the (forward, backward) pair's passes compared too
        joint = {p.name: p.numerics for p in backend.record.passes if p.stage in ("joint", "partition")}
        assert "remat" in joint and set(joint.values()) == {"equal before and after"}, joint


def test_a_dump_repeats_no_file_and_shows_regions_under_the_models_lines(tmp_path):
    blocks, reference = _blocks_and_reference()
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("default"), executors=["cpp", "aten"],
                                             dump_dir=tmp_path / "dump"))  # fmt: skip
    for b in blocks:
        b.compile(backend=backend)
    _assert_same_step(blocks, reference)
    for part in ("forward", "backward"):  # the forward's input repeated the partition's file
        files = sorted((tmp_path / "dump" / f"g0.{part}").glob("*.py"))
        assert files[0].name == "00_input.py" and not any(f.name.endswith("_partition_remat.py") for f in files)
        assert files[0].read_text().splitlines()[0] == f"# g0.{part}, input (as partition_remat left it)", files[0]
        bodies = [f.read_text().split("\n", 1)[1] for f in files]
        assert bodies[0] != bodies[1], files  # (the metadata-only pass's file: test_explain_prints_passes_...)
    lowered = next((tmp_path / "dump" / "g0.forward").glob("*_lowered.py")).read_text()
    assert "region_0 = " in lowered and "No stacktrace found" not in lowered
    above = lowered.split("region_0 = ")[0].rstrip().rsplit("\n", 1)[-1]
    assert "# File: " in above and "model.py" in above, above  # torch's printer said "No stacktrace found"


@pytest.mark.parametrize("name", ["dce", "cse", "fuse_rmsnorm", "fuse_swiglu", "fuse_rope", "remat",
                                  "partition_regions"])  # fmt: skip
def test_each_pass_alone_keeps_a_llama_block_exact(name):
    """Each pass on its own (the presets test them together), checked against eager and, with
    debug_numerics, against the graph before it."""
    blocks, reference = _blocks_and_reference(1)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes([name]), executors=["cpp", "aten"],
                                             debug_numerics=True))  # fmt: skip
    blocks[0].compile(backend=backend)
    _assert_same_step(blocks, reference)


@pytest.mark.parametrize("bf16_kernels", [True, False], ids=["cpu-with-bf16-gemm", "cpu-without"])
def test_llama_blocks_bf16_autocast_match_eager_within_bf16_tolerance(bf16_kernels, monkeypatch):
    # The CPU's answer forced each way: without bf16 GEMM kernels, cpu_half_gemm runs the products as
    # fp32 GEMMs (this project's AVX2 machines have none; CI's may).
    monkeypatch.setattr(cpu_half_gemm, "cpu_has_half_gemm", lambda dtype: bf16_kernels)
    blocks, reference = _blocks_and_reference()
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"]))
    for b in blocks:
        b.compile(backend=backend)
    with torch.autocast("cpu", torch.bfloat16):
        _assert_same_step(blocks, reference, rtol=2e-2, atol=2e-2)
    assert backend.record.regions_per_executor().get("cpp", 0) > 0
    rewritten = {p.graph: p.counts["rewritten"] for p in backend.record.passes if p.name == "cpu_half_gemm"}
    if bf16_kernels:
        assert not any(rewritten.values()), rewritten
    else:  # a block's forward: q/k/v, output and three MLP products; the backward: two per product
        assert rewritten["g0.forward"] >= 5 and rewritten["g0.backward"] >= 10, rewritten


def test_inductor_executor_takes_regions_and_matches_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def f(x, w):  # RMSNorm-like: one region with a reduction and its epilogue
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w).sum(-1)

    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["partition_regions"]),
                                             executors=["inductor", "aten"]))  # fmt: skip
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    got = torch.compile(f, backend=backend)(x, w)
    want = f(x, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want.sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)
    executors = backend.record.regions_per_executor()
    assert executors.get("inductor", 0) >= 2, executors  # forward and backward regions


def test_inductor_executor_takes_a_softmax_region(tmp_path, monkeypatch):
    """A region keeps `_softmax` whole; Inductor, handed it undecomposed, failed with "both a fallback and
    a decomp for same op" and the region fell back to ATen (a new user's mixture of experts)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def f(x, w):
        return (x.softmax(-1) * w).sum(-1)

    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["partition_regions"]),
                                             executors=["inductor", "aten"]))  # fmt: skip
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    got = torch.compile(f, backend=backend)(x, w)
    torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-6)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (want,) = torch.autograd.grad(f(x, w).sum(), x)
    torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-6)
    assert not backend.record.fallbacks, [f.line() for f in backend.record.fallbacks]
    assert backend.record.regions_per_executor().get("inductor", 0) >= 2, backend.record.regions_per_executor()


def _first_add_becomes(gm, target) -> PassResult:
    """A wrong pass for the debug mode to catch: the graph's first add turned into ``target``."""
    for node in gm.graph.nodes:
        if node.target == torch.ops.aten.add.Tensor:
            node.target = target
            return PassResult(True, "broke an add")
    return PassResult(False)


@register_pass("test_breaks_numerics", "post_grad")
def _breaks_numerics(gm, options: PassOptions, ctx) -> PassResult:
    return _first_add_becomes(gm, torch.ops.aten.sub.Tensor)


def test_debug_numerics_names_the_pass_that_diverges():
    blocks, _ = _blocks_and_reference(1)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["dce", "test_breaks_numerics"]),
                                             executors=["aten"], debug_numerics=True))  # fmt: skip
    blocks[0].compile(backend=backend)
    cos, sin = rope_tables(ARGS.head_dim, T, ARGS.rope_theta)
    with pytest.raises(Exception, match="test_breaks_numerics") as info:
        blocks[0](torch.randn(2, T, ARGS.dim, requires_grad=True), cos, sin)
    assert isinstance(info.value, PassNumericsError) or "PassNumericsError" in str(info.value)


@register_pass("test_leaves_a_graph_that_raises", "post_grad")
def _leaves_a_graph_that_raises(gm, options: PassOptions, ctx) -> PassResult:
    """A matrix product of 3-d tensors in place of an add: a graph that lints and cannot run."""
    return _first_add_becomes(gm, torch.ops.aten.mm.default)


def test_debug_numerics_names_a_pass_whose_graph_raises():
    """A pass that left a graph raising on the inputs its input graph ran on stopped the compile with the
    op's error, naming no pass."""
    blocks, _ = _blocks_and_reference(1)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["dce", "test_leaves_a_graph_that_raises"]),
                                             executors=["aten"], debug_numerics=True))  # fmt: skip
    blocks[0].compile(backend=backend)
    cos, sin = rope_tables(ARGS.head_dim, T, ARGS.rope_theta)
    with pytest.raises(Exception, match="pass 'test_leaves_a_graph_that_raises' left a graph that raises"):
        blocks[0](torch.randn(2, T, ARGS.dim, requires_grad=True), cos, sin)


@register_pass("test_breaks_joint", "joint")
def _breaks_joint(gm, options: PassOptions, ctx) -> PassResult:
    return _breaks_numerics(gm, options, ctx)


@register_pass("test_breaks_gradient", "partition")
def _breaks_gradient(pair, options: PassOptions, ctx) -> PassResult:
    """Doubles the backward's first gradient, forward untouched: what a wrong recomputation could do."""
    fw, bw = pair
    (out,) = bw.graph.find_nodes(op="output")
    grads = list(out.args[0])
    i = next(i for i, g in enumerate(grads) if g is not None)
    with bw.graph.inserting_before(out):
        grads[i] = bw.graph.call_function(torch.ops.aten.mul.Tensor, (grads[i], 2.0))
    out.args = (tuple(grads),)
    bw.recompile()
    return PassResult(True, "doubled a gradient", graph=(fw, bw))


@pytest.mark.parametrize("wrong", ["test_breaks_joint", "test_breaks_gradient"])
def test_debug_numerics_names_a_joint_or_partition_pass_that_diverges(wrong):
    """Only the forward's and the backward's passes were compared: a wrong pass on the joint graph (before
    the cut) or on the pair (remat's stage) trained on."""
    blocks, _ = _blocks_and_reference(1)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["dce", wrong]), executors=["aten"],
                                             debug_numerics=True))  # fmt: skip
    blocks[0].compile(backend=backend)
    cos, sin = rope_tables(ARGS.head_dim, T, ARGS.rope_theta)
    with pytest.raises(Exception, match=wrong) as info:
        blocks[0](torch.randn(2, T, ARGS.dim, requires_grad=True), cos, sin).sum().backward()
    assert isinstance(info.value, PassNumericsError) or "PassNumericsError" in str(info.value)


class _DropoutMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + torch.nn.functional.dropout(self.down(torch.nn.functional.gelu(self.up(x))), 0.3)


@pytest.mark.parametrize("passes", [["dce", "partition_regions"], ["dce", "cpu_dropout", "partition_regions"]])
def test_debug_numerics_compares_graphs_with_dropout_on_the_same_random_draws(passes):
    """A compiler engineer's trial: any model with dropout stopped with "pass 'fuse_attention' changed the
    graph's results" (a pass that matched nothing), each graph having drawn its own masks. A pass that
    draws them otherwise (cpu_dropout: in its kernel) is said to be not compared."""
    torch._dynamo.reset()
    model = _DropoutMLP()
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(passes), executors=["cpp", "aten"],
                                             debug_numerics=True))  # fmt: skip
    compiled = torch.compile(model, backend=backend)
    compiled(torch.randn(4, 8, 16, requires_grad=True)).sum().backward()
    said = {(p.graph.rsplit(".", 1)[-1], p.name): p.numerics for p in backend.record.passes if p.numerics}
    assert said[("forward", "partition_regions")] == "equal before and after", said
    if "cpu_dropout" in passes:
        assert said[("forward", "cpu_dropout")].startswith("not compared: it changes which random numbers"), said
    assert "debug_numerics: " in backend.record.compiled_line()
    torch._dynamo.reset()


class _BranchOnAValue(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.abs().mean().item() > 0.01:  # a graph break; the code after it takes the float as an input
            h = h * 0.9
        return torch.tanh(h) + h


def test_a_graph_dynamo_abandons_is_not_counted_and_a_recompile_is_said():
    """A compiler engineer's trial: a value read from a tensor made Dynamo recompile the code after the
    break, abandoning one graph half way (TensorifyScalarRestartAnalysis) after the backend had counted it:
    "4 graphs", one with pre-grad passes only, and no word of the recompile."""
    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["dce", "partition_regions"]),
                                             executors=["aten"]))  # fmt: skip
    handed, compile_graph = [], backend._compile_new_dynamo_graph
    backend._compile_new_dynamo_graph = lambda *a: handed.append(1) or compile_graph(*a)
    compiled = torch.compile(_BranchOnAValue(), backend=backend)
    for seed in range(3):
        compiled(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)).sum().backward()
    record = backend.record
    with_forward = {g.name.split(".")[0] for g in record.graphs}
    assert set(record.traced_functions) == with_forward and record.dynamo_graphs == len(with_forward), \
        (record.traced_functions, with_forward)
    assert len(handed) > len(with_forward), handed  # Dynamo did abandon one: the case at hand
    (label, n), = record.recompiled().items()
    assert "torch_dynamo_resume_in_forward" in label and n >= 1
    assert f"{n} recompile" in record.compiled_line()
    torch._dynamo.reset()


@register_pass("test_drops_dropout", "post_grad")
def _drops_dropout(gm, options: PassOptions, ctx) -> PassResult:
    """Replaces ATen's dropout with its input and an all-true mask: a wrong pass that draws nothing."""
    for node in list(gm.graph.nodes):
        if node.target == torch.ops.aten.native_dropout.default:
            with gm.graph.inserting_before(node):
                x = node.args[0]
                mask = gm.graph.call_function(torch.ops.aten.ge.Scalar, (x, float("-inf")))
                pair = gm.graph.call_function(lambda a, m: (a, m), (x, mask))
            node.replace_all_uses_with(pair)
            gm.graph.erase_node(node)
            gm.recompile()
            return PassResult(True, "dropped a dropout")
    return PassResult(False)


def test_debug_numerics_still_names_a_pass_that_drops_an_aten_dropout():
    """(a review) A graph whose random ops changed was said "not compared" whatever changed them: only
    accelrun's own generator's draws (cpu_dropout's) are exempt."""
    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["dce", "test_drops_dropout"]), executors=["aten"],
                                             debug_numerics=True))  # fmt: skip
    with pytest.raises(Exception, match="pass 'test_drops_dropout' changed the graph's results"):
        torch.compile(_DropoutMLP(), backend=backend)(torch.randn(4, 8, 16, requires_grad=True)).sum().backward()
    torch._dynamo.reset()


def test_one_function_compiled_by_several_backends_or_for_several_kinds_is_no_recompile():
    """(a review) Repeated labels were read as recompiles: pipeline stages compiling one block class, and the
    graph cache's entries for each kind of input ("Linear.forward (torch.nn)" for every outside Linear)."""
    from accelrun.compile.record import CompileRecord, merge_records

    parts = []
    for stage in ("stage0", "stage1"):
        rec = CompileRecord()
        rec.traced_functions = {"g0": "Block.forward (model.py:3)", "g1": "Block.forward (model.py:3)"}
        parts.append((stage, rec))
    merged = merge_records(parts)
    assert merged.recompiled() == {} and "recompile" not in merged.compiled_line()
    parts[1][1].recompiles["Block.forward (model.py:3)"] += 1  # one that Dynamo did compile again
    assert merge_records(parts).recompiled() == {"stage1: Block.forward (model.py:3)": 1}


def test_debug_numerics_tolerates_reordered_sums_and_nothing_more():
    """A sum of large terms cancelling to a small value differs by the terms' rounding under another
    summation order: compared against the tensor's scale, not its own. Real differences still fail."""
    from accelrun.compile.numerics import compare_outputs

    ref = torch.tensor([2000.0, 0.57, -3.0, float("nan"), float("inf")])
    reordered = ref + torch.tensor([1e-4, 5e-5, 0.0, 0.0, 0.0])
    assert compare_outputs([ref], [reordered]) is None
    assert "output 0" in compare_outputs([ref], [ref + torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0])])
    assert "output 0" in compare_outputs([ref], [ref.nan_to_num(nan=1.0) + 1e-4])  # a NaN lost
    assert "output 0" in compare_outputs([ref[:3]], [ref[:3] * 1.001])
    # Errors everywhere but at the largest value fail, however large that value is.
    big = torch.cat([torch.tensor([100.0]), torch.full((999,), 1e-3)])
    assert "output 0" in compare_outputs([big], [torch.cat([big[:1], torch.zeros(999)])])
    big16 = torch.cat([torch.tensor([100.0]), torch.full((999,), 0.1)]).bfloat16()
    assert "output 0" in compare_outputs([big16], [torch.cat([big16[:1], torch.full((999,), -0.8).bfloat16()])])


@pytest.mark.parametrize(("override", "expected"), [
    ("compile.passes=[dce, csee]", "did you mean 'cse'"),
    ("compile.passes=maximum", "unknown pass preset 'maximum'"),
    ("compile.passes=default-remt", "did you mean 'remat'"),
    ("compile.passes=[{partition_regions: {max_node: 3}}]", "did you mean 'max_nodes'"),
    ("compile.executors=[cpu, aten]", "unknown executor 'cpu'"),
])  # fmt: skip
def test_bad_compile_settings_are_exit_2_with_the_key(override, expected):
    result = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), "compile.backend=accelrun", override])
    assert result.exit_code == 2, result.output
    assert expected in result.output
    assert "compile." in result.output and "override" in result.output


def test_explain_prints_passes_and_writes_graphs(tiny, tmp_path):
    result = CliRunner().invoke(cli, ["compile", "explain", str(DEFAULT_CONFIG), *tiny(1),
                                      "compile.passes=[dce, cse, partition_regions]",
                                      "compile.executors=[aten]", "--steps", "1", "name=mine-explain"])  # fmt: skip
    assert result.exit_code == 0, result.output
    for expected in ("partition_regions", "formed", "fusion regions by executor", "compile time"):
        assert expected in result.output
    # the kernel cache named as such, and the graph cache said to be unused because explain compiles
    # afresh (it blamed compile.dump, which the user never set)
    said = " ".join(result.output.split())
    assert "kernel cache (the regions' built kernels): " in said and "compile.dump" not in said
    assert "graph cache: not used (explain compiles every graph afresh, to show each pass)" in said
    assert "graphs traced from: g0: TransformerBlock.forward (llama/model.py:" in said  # not g0 alone
    (dump,) = (tmp_path / "runs").glob("*/*/compile")
    assert dump.parent.parent.name == "mine-explain"  # not doubled: mine-explain-explain
    record = json.loads((dump / "record.json").read_text())
    assert record["summary"]["regions_per_executor"]["aten"] > 0
    assert (dump / "g0.backward" / "00_input.py").exists()
    assert any(p.name.endswith("partition_regions.py") for p in (dump / "g0.forward").iterdir())


@pytest.mark.parametrize("executors", ["[aten]", "[cpp, aten]"])
def test_training_with_the_accelrun_backend_matches_eager(tiny, executors):
    eager = train(load_config(DEFAULT_CONFIG, tiny(4)), command="test")
    compiled = train(load_config(DEFAULT_CONFIG, tiny(4, "compile.backend=accelrun", "compile.scope=loss",
                                                   f"compile.executors={executors}")), command="test")  # fmt: skip
    losses = [[m["loss"] for m in read_metrics(r.run_dir / "metrics.jsonl")] for r in (eager, compiled)]
    # fp32: the fused kernels sum in another order than ATen's, so equal to ~1e-6, not bitwise.
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    report = json.loads((compiled.run_dir / "report.json").read_text())
    compiler = report["compiler"]
    assert compiler["dynamo_graphs"] == 2  # one block graph for both blocks + the loss head
    assert compiler["graph_breaks"] == 0
    assert compiler["passes_fired"].get("fuse_linear_cross_entropy") == 1
    if "cpp" in executors:
        assert compiler["regions_per_executor"]["cpp"] >= 10, compiler["regions_per_executor"]


def test_second_compile_of_the_same_graph_hits_the_cache(tmp_path):
    records = []
    for _ in range(2):
        torch._dynamo.reset()
        blocks, _ = _blocks_and_reference(1)
        backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path / "cache"))
        blocks[0].compile(backend=backend)
        cos, sin = rope_tables(ARGS.head_dim, T, ARGS.rope_theta)
        blocks[0](torch.randn(2, T, ARGS.dim, requires_grad=True), cos, sin).sum().backward()
        records.append(backend.record)
    cold, warm = records
    # Cold: every distinct kernel is built once (a region identical to one built before is a hit).
    assert cold.cache_misses > 0
    assert warm.cache_misses == 0 and warm.cache_hits == cold.cache_hits + cold.cache_misses


def test_the_backward_graph_is_lowered_with_the_forward(tmp_path):
    # Lowered before the forward runs (its regions' g++ overlaps the forward), not at the first backward;
    # the step still matches eager's.
    torch._dynamo.reset()
    blocks, reference = _blocks_and_reference(1)
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path / "cache"))
    blocks[0].compile(backend=backend)
    cos, sin = rope_tables(ARGS.head_dim, T, ARGS.rope_theta)
    blocks[0](torch.randn(2, T, ARGS.dim, requires_grad=True), cos, sin)  # a forward, no backward
    assert [g.name for g in backend.record.graphs] == ["g0.forward", "g0.backward"]
    assert backend.record.regions_per_executor().get("cpp", 0) > 0
    _assert_same_step(blocks, reference)
    assert [g.name for g in backend.record.graphs] == ["g0.forward", "g0.backward"]  # not lowered again


def test_graph_breaks_are_counted_with_their_reasons():
    def f(x):
        y = x.sin()
        print("a side effect Dynamo cannot put in a graph")
        return y.cos()

    backend = AccelrunBackend(CompileOptions(executors=["aten"]))
    torch.compile(f, backend=backend)(torch.randn(4))
    breaks = backend.collect_graph_breaks()
    assert sum(breaks.values()) >= 1 and backend.record.dynamo_graphs == 2
    assert any("print" in reason.lower() or "builtin" in reason.lower() for reason in breaks), breaks


def test_compile_passes_lists_each_option_s_default_value():
    """An option whose default comes from a factory (remat's recompute list) shows that list, not
    pydantic's marker for it."""
    from accelrun.cli.compile_cmd import option_defaults
    from accelrun.compile.passes.base import registered_passes

    assert option_defaults(registered_passes()["remat"].options) == \
        "budget_mb=None, recompute=['pointwise', 'view'], max_chain=16"
    assert CliRunner().invoke(cli, ["compile", "passes"]).exit_code == 0


def test_a_region_every_generator_declines_is_named_in_the_report_with_their_reasons():
    # A run's report counted such a region under "fusion regions by executor: aten 1" and said
    # nothing more: the reason was in `compile explain` only (transformers' OPT, found by a walk).
    from accelrun.report.markdown import _compiler_section

    backend = AccelrunBackend()
    compiled = torch.compile(lambda x: ((x * 2).sum(1) + 1).exp(), backend=backend)
    compiled(torch.randn(3, 400, 5, requires_grad=True)).sum().backward()
    assert backend.record.regions_per_executor() == {"aten": 1}  # a sum over a middle axis: cpp declines
    (line,) = backend.record.regions_left_to_aten()
    assert line.startswith("g0.forward region 0 (4 ops: mul.Tensor, sum.dim_IntList") and "cpp: reduction over axes [1]" in line
    assert f"- left to ATen: {line}" in _compiler_section(backend.record.summary())


def test_gradients_that_view_one_another_stay_apart_under_accumulation(tmp_path):
    """Two parameters whose gradients are the same values in two shapes (``p1 + p2.view(...)``): the
    backward returns both. Had the second been a view of the first (the region writes one, the graph
    views it), fast_calls' reinterpretation would hand autograd two tensors on one storage, and
    accumulating a second micro-batch into one would change the other (errors of 3.8 from the second
    step; found in review). Compiled, the gradients stay eager's over steps of two micro-batches."""

    class TwoShapes(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p1 = torch.nn.Parameter(torch.randn(512, 64))
            self.p2 = torch.nn.Parameter(torch.randn(16, 32, 64))
            self.b = torch.nn.Parameter(torch.randn(64))

        def forward(self, t):
            h = self.p1 + (self.p2 + self.b).view(512, 64)
            return (h.tanh() * t).sum()

    torch.manual_seed(0)
    model = TwoShapes()
    reference = copy.deepcopy(model)
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path))
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):  # fast_calls settles its views after two calls: steps 2-4 run the settled code
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        for _ in range(2):
            t = torch.randn(512, 64, generator=gen)
            compiled(t).backward()
            reference(t).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert model.p1.grad.untyped_storage().data_ptr() != model.p2.grad.untyped_storage().data_ptr()
    assert sum(r.executor == "cpp" for r in backend.record.regions) >= 1  # the regions ran compiled


def test_a_passes_description_is_its_docstrings_first_sentence_whole():
    """`accelrun compile passes` cut descriptions at the docstring's first line: "...(cross-entropy's); the"."""
    from accelrun.compile.passes.base import first_sentence, registered_passes

    assert first_sentence("Replace a with b, e.g. c.\n  More. And more.") == "Replace a with b, e.g. c."
    assert first_sentence("Two lines of one\n    sentence here.\n\nAnother paragraph.") == "Two lines of one sentence here."
    for name, spec in registered_passes().items():
        assert not spec.doc or spec.doc.endswith((".", ")")), (name, spec.doc)


def test_a_second_backward_through_a_retained_graph_matches_eager(tmp_path):
    """A trial's GAN-style and multi-loss steps: every `backward(retain_graph=True)` under accelrun failed
    ("compiled with non-empty donated buffers"), where eager, aot_eager and Inductor train alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    reference = copy.deepcopy(model)
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("default"), executors=["cpp", "aten"],
                                             cache_dir=tmp_path))  # fmt: skip
    x = torch.randn(4, 32)
    torch._dynamo.reset()
    for m in (torch.compile(model, backend=backend), reference):
        y = m(x)
        y.pow(2).mean().backward(retain_graph=True)  # a second loss through the same graph follows
        y.sum().backward()
    torch._dynamo.reset()
    assert backend.record.dynamo_graphs == 1
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_ops_outside_regions_count_the_calls_that_compute_not_views_or_tuple_reads():
    """A compiler engineer's trial: "ops outside regions (ATen calls) 111", a third of them views and getitems."""
    import operator

    from accelrun.compile.backend import computes_outside_regions

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    v = graph.call_function(torch.ops.aten.view.default, (x, [4, 4]))
    mm = graph.call_function(torch.ops.aten.mm.default, (v, v))
    pair = graph.call_function(torch.ops.aten.max.dim, (mm, 0))
    first = graph.call_function(operator.getitem, (pair, 0))
    parts = graph.call_function(torch.ops.aten.split_with_sizes.default, (first, [2, 2]))  # a view op, not listed
    graph.output((first, parts))
    assert [n.name for n in graph.nodes if computes_outside_regions(n)] == ["mm_default", "max_dim"]


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_a_size_marked_dynamic_stays_symbolic(dim):
    """torch._dynamo.mark_dynamic on a non-leading size: the code generators read it as a number, Dynamo's
    guard fixing it, and Dynamo refused the graph ("you marked ... as dynamic but your code specialized
    it": a fuzzer's x * 2 + 1). Regions over it are left to ATen; one graph serves every size."""
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"]))

    def fn(x):
        return (torch.nn.functional.gelu(x, approximate="tanh") * 2 + 1).mean(-1)

    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for size in (5, 7):
        shape = [2, 3, 4]
        shape[dim] = size
        x = torch.randn(*shape, requires_grad=True)
        torch._dynamo.mark_dynamic(x, dim)
        x_ref = x.detach().clone().requires_grad_()
        out, want = compiled(x), fn(x_ref)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad)
    assert backend.record.dynamo_graphs == 1 and not backend.record.recompiles


def test_debug_numerics_does_not_blame_a_pass_for_a_graph_that_cannot_run_on_sample_values():
    """Sample values are random floats and zero indices: a graph before the pass that fails on them says
    nothing of the pass (an exception there stopped the pass as if it had broken the graph)."""
    from accelrun.compile.numerics import check_pass

    def needs_a_positive(x):
        if x.min() < 0:
            raise ValueError("expects positive values")
        return x

    said = check_pass("pass 'x'", needs_a_positive, torch.abs, [torch.randn(8)])
    assert said == "not compared: the graph before it does not run on sample inputs (ValueError: expects positive values)"


def test_debug_numerics_keeps_a_size_marked_dynamic_symbolic():
    """Sampling the inputs read a symbolic size with int(), which guards it to its example value: a size
    marked dynamic then failed the compile (ConstraintViolationError), now over the joint graph too."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16))
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes("default"), executors=["cpp", "aten"],
                                             debug_numerics=True))  # fmt: skip
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8, 16, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 1)
    compiled(x).sum().backward()
    y = torch.randn(4, 11, 16, requires_grad=True)
    torch.testing.assert_close(compiled(y), model(y), rtol=1e-5, atol=1e-6)
    assert backend.record.dynamo_graphs == 1  # no recompile for the other length
    said = [p.numerics for p in backend.record.passes if p.numerics]
    assert said and "debug_numerics: " in backend.record.compiled_line()
    torch._dynamo.reset()

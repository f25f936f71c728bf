"""The ``simplify`` pass and the region kinds it feeds: a loss head's and a sliced tensor's gradients
(scatters into zeros in autograd's formulas) and a log-softmax of upcast logits end up inside fused
regions, with the same values as eager."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.op_kinds import node_kind
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import PassContext, PassOptions, resolve_passes
from accelrun.compile.passes.simplify import simplify

aten = torch.ops.aten
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


def _compile_and_compare(fn, inputs, tmp_path, dtype):
    """fn compiled with the default passes and the cpp executor (strict: no silent fallback) against
    eager: outputs and gradients. Returns the backend and the lowered backward graph's source."""
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path / "cache",
                                             dump_dir=tmp_path / "dump", strict=True))  # fmt: skip
    eager_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    comp_in = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    expected, got = fn(*eager_in), torch.compile(fn, backend=backend, fullgraph=True)(*comp_in)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    expected.sum().backward()
    got.sum().backward()
    for a, b in zip(eager_in, comp_in, strict=True):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, **TOL[dtype])
    lowered = (tmp_path / "dump" / "g0.backward").glob("*_lowered.py")
    return backend, next(lowered).read_text()


def _fired(backend: AccelrunBackend, name: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in backend.record.passes:
        if p.name == name:
            for k, v in p.counts.items():
                counts[k] = counts.get(k, 0) + v
    return counts


def test_a_causal_lm_loss_head_fuses_its_softmax_and_its_one_hot_gradient(tmp_path):
    # As transformers writes it: the logits upcast, labels shifted with -100 padding, a summed loss.
    def loss_head(h, w, labels):
        logits = (h @ w).float()
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100,
                               reduction="sum") / 7  # fmt: skip

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        h, w = torch.randn(2, 16, 8, generator=g).to(dtype), torch.randn(8, 40, generator=g).to(dtype)
        labels = torch.randint(0, 40, (2, 16), generator=g)
        backend, backward = _compile_and_compare(loss_head, [h, w, labels], tmp_path / str(dtype), dtype)
        assert _fired(backend, "simplify")["scatter"] == 1
        assert _fired(backend, "simplify")["constant_pad_nd"] == 1  # the shifted labels: a cat in a region
        forward = next((tmp_path / str(dtype) / "dump" / "g0.forward").glob("*_lowered.py")).read_text()
        assert "constant_pad_nd" not in forward and "aten.cat" not in forward
        assert "aten.scatter" not in backward and "full_like" not in backward  # the one-hot is in a region
        region_ops = [op for r in backend.record.regions for op in r.ops]
        assert "eq.Tensor" in region_ops and "exp" in region_ops
        # loss_row_stats: the log-softmax saved as its row max and log-sum-exp, computed from the logits
        # in one region (with bf16 logits their fp32 upcast in it too: no fp32 copy of the logits), and
        # recomputed in the backward's region.
        assert _fired(backend, "loss_row_stats") == {"log_softmax": 1, "changed": 1}
        forward_regions = [set(r.ops) for r in backend.record.regions if r.graph.endswith("forward")]
        assert any({"amax", "exp", "log"} <= ops for ops in forward_regions), forward_regions
        if dtype == torch.bfloat16:
            assert any({"_to_copy", "amax"} <= ops for ops in forward_regions), forward_regions


def test_a_sliced_tensor_s_gradient_is_computed_in_the_region_not_scattered_into_zeros(tmp_path):
    def rotate_half(x, cos, sin):  # transformers' RoPE
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).square()

    g = torch.Generator().manual_seed(1)
    x, cos, sin = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(3))
    backend, backward = _compile_and_compare(rotate_half, [x, cos, sin], tmp_path, torch.float32)
    assert _fired(backend, "simplify").get("slice_scatter", 0) >= 2
    assert "slice_scatter" not in backward and "aten.full" not in backward


def _graph_of(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def test_only_scatters_into_constants_with_one_index_per_row_are_rewritten():
    x, idx1, idx2 = torch.randn(4, 6), torch.tensor([[1], [0], [5], [2]]), torch.tensor([[1, 2]] * 4)

    def scatters(x, idx1, idx2):
        one = torch.zeros_like(x).scatter(1, idx1, -1.0)  # rewritten
        two = torch.zeros_like(x).scatter(1, idx2, 2.0)  # two indices per row: left
        into_x = x.scatter(1, idx1, 3.0)  # not a constant base: left
        every_other = torch.zeros(4, 6).slice_scatter(x[:, :3], 1, 0, 6, 2)  # step 2: left
        return one, two, into_x, every_other

    gm = _graph_of(scatters, x, idx1, idx2)
    expected = scatters(x, idx1, idx2)
    result = simplify(gm, PassOptions(), PassContext("forward"))
    assert result.counts == {"scatter": 1}
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.scatter.value) == 2 and aten.where.self in targets
    for got, want in zip(gm(x, idx1, idx2), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_constants_and_same_device_casts_are_region_members():
    gm = _graph_of(lambda x: x.to(torch.float32) * torch.full_like(x, 2.0, dtype=torch.float32),
                   torch.randn(3, dtype=torch.bfloat16))  # fmt: skip
    kinds = {n.target: node_kind(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert kinds[aten.full_like.default] == "constant" and kinds[aten._to_copy.default] == "pointwise"
    cast = next(n for n in gm.graph.nodes if n.target is aten._to_copy.default)
    cast.kwargs = {**cast.kwargs, "device": torch.device("cpu")}  # AOTAutograd spells it so
    assert node_kind(cast) == "pointwise"
    cast.kwargs = {**cast.kwargs, "device": torch.device("meta")}  # a real move is not a cast
    assert node_kind(cast) == "other"


def test_a_cat_drops_empty_parts_and_one_part_left_is_a_contiguous_copy():
    # transformers' DynamicCache concatenates each step's keys onto an empty tensor.
    def cached(k, v):
        empty = k.new_zeros(2, 3, 0, 4)
        return torch.cat([empty, k.transpose(1, 2)], -2), torch.cat([v, empty, v], -2)

    k, v = torch.randn(2, 5, 3, 4), torch.randn(2, 3, 5, 4)
    gm = _graph_of(cached, k, v)
    expected = cached(k, v)
    result = simplify(gm, PassOptions(), PassContext("forward"))
    assert result.counts == {"empty_cat_parts": 2}
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.cat.default) == 1 and aten.clone.default in targets
    got = gm(k, v)
    assert got[0].is_contiguous()
    for g, want in zip(got, expected, strict=True):
        torch.testing.assert_close(g, want, rtol=0, atol=0)



def test_a_constant_pad_is_a_cat_with_constant_parts_and_a_crop_is_left_alone():
    cases = [
        (lambda x: F.pad(x, (0, 1), value=-100), torch.randint(0, 9, (4, 6)), 1),  # shifted labels
        (lambda x: F.pad(x, (2, 1, 0, 3), value=1.5), torch.randn(3, 4, 5), 1),  # two dims, both sides
        (lambda x: F.pad(x, (1, 0)), torch.randn(2, 3, dtype=torch.bfloat16), 1),
        (lambda x: F.pad(x, (1, -1)), torch.randn(2, 3), 0),  # a negative pad crops
        # a channels-last input keeps its layout through the pad; a cat would not
        (lambda x: F.pad(x, (1, 1, 1, 1)), torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), 0),
    ]
    for fn, x, rewritten in cases:
        gm = _graph_of(fn, x)
        result = simplify(gm, PassOptions(), PassContext("forward"))
        assert result.counts.get("constant_pad_nd", 0) == rewritten
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert (aten.constant_pad_nd.default in targets) == (not rewritten)
        got, want = gm(x), fn(x)
        assert got.dtype == want.dtype and got.stride() == want.stride() and torch.equal(got, want)


def test_an_accumulating_index_put_is_an_index_add():
    # An embedding's backward: rows of values summed into the rows their (possibly repeated or
    # negative, i.e. counted from the end) indices name; into zeros and into a tensor of values.
    idx, vals, start = torch.tensor([[0, -1], [2, 0]]), torch.randn(2, 2, 3), torch.randn(6, 3)

    def put(idx, vals, start):
        summed = torch.full((6, 3), 0.0).index_put((idx,), vals, accumulate=True)
        onto = start.index_put((idx,), vals, accumulate=True)
        replaced = torch.full((6, 3), 0.0).index_put((idx,), vals)  # not accumulating: left
        return summed, onto, replaced

    gm = _graph_of(put, idx, vals, start)
    expected = put(idx, vals, start)
    assert simplify(gm, PassOptions(), PassContext("backward")).counts == {"index_put": 2}
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.index_add.default) == 2 and targets.count(aten.index_put.default) == 1
    for got, want in zip(gm(idx, vals, start), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_an_embeddings_backward_of_any_length_is_an_index_add():
    """In the graph Dynamo traces for any sequence length an embedding's index is [batch, length] with
    a symbolic length: flattened with -1, its backward is an index_add too, with no guard on the
    length (one graph for the lengths after the first). Until 2026-12-05 it stayed index_put, 10x
    slower in nanoGPT-sized steps."""
    torch.manual_seed(0)
    model, twin = torch.nn.Embedding(10, 4), torch.nn.Embedding(10, 4)
    twin.load_state_dict(model.state_dict())
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(["simplify"]), executors=["aten"], strict=True))
    compiled = torch.compile(model, backend=backend)
    for length in (3, 5, 7, 4):
        idx = torch.randint(-10, 10, (2, length)) % 10
        compiled(idx).square().sum().backward()
        twin(idx).square().sum().backward()
    torch.testing.assert_close(model.weight.grad, twin.weight.grad, rtol=1e-6, atol=1e-6)
    assert backend.record.dynamo_graphs == 2, backend.record.compiled_line()
    rewritten = {p.graph: p.counts["index_put"] for p in backend.record.passes if "index_put" in p.counts}
    assert rewritten == {"g0.backward": 1, "g1.backward": 1}, rewritten


def test_an_accumulating_index_put_off_the_cpu_is_left_alone():
    # On CUDA index_add sums with atomics (run-to-run differences); only the CPU gets the rewrite.
    # Meta tensors stand for a device that is not the CPU.
    idx, vals = torch.tensor([[0, -1], [2, 0]], device="meta"), torch.randn(2, 2, 3, device="meta")
    gm = _graph_of(lambda i, v: torch.zeros(6, 3, device="meta").index_put((i,), v, accumulate=True), idx, vals)
    assert simplify(gm, PassOptions(), PassContext("backward")).counts == {}
    assert aten.index_put.default in [n.target for n in gm.graph.nodes if n.op == "call_function"]

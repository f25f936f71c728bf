"""accelrun's C++ attention kernel (``fused.attention``) and the ``cpu_attention`` pass that routes SDPA
calls to it: outputs and gradients against PyTorch's own SDPA on the same inputs, torch.library's
opcheck on the custom ops, what the pass takes and what it leaves with ATen."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from accelrun.compile.fused import attention as kernel
from accelrun.models.families.llama.model import LlamaArgs, TransformerBlock, repeat_kv, rope_tables
from tests.compile.test_pass_fusion import FUSION_PASSES, Fused, randn, run_both

TOL = {torch.float32: {"rtol": 1e-5, "atol": 2e-6}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


def reference(q, k, v, scale, causal):
    """PyTorch's SDPA in fp32 on the same values (k, v repeated to q's heads)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, repeat_kv(k, q.shape[1]) if group > 1 else k,
                                         repeat_kv(v, q.shape[1]) if group > 1 else v, is_causal=causal, scale=scale)  # fmt: skip
    return out, (q, k, v)


def test_kernel_is_built_for_this_cpus_vector_width():
    # 64-byte GCC vectors on an AVX2 CPU compile element by element: the kernel ran at a tenth of
    # ATen's speed there, with correct results. The library's vectors are the CPU's own.
    if platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").exists():
        pytest.skip("reads x86 feature flags from Linux's /proc/cpuinfo")
    if kernel.find_compiler() is None:
        pytest.skip("no C++ compiler: attention runs in ATen")
    flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    lib = kernel._library(torch.float32)
    assert lib is not None
    assert lib.attention_vector_lanes() == (16 if "avx512f" in flags else 8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "B,Hq,Hkv,S,D",
    [(2, 6, 2, 256, 32),  # the debug Llama's attention (grouped-query)
     (1, 4, 4, 100, 16),  # torchtitan's debug head_dim; a length that is no multiple of the blocks
     (2, 4, 1, 77, 64),  # multi-query
     (1, 2, 2, 33, 48),  # head_dim with a 16-wide tail
     (1, 2, 1, 300, 128),
     # last blocks of 7, 6, 3 and 2 rows (blocks of 8, AVX-512) and of 5, 1 and 4 rows (blocks of 6,
     # AVX2): cut into blocks of 4, 2 and 1 rows, the only counts besides a whole block's
     (1, 2, 1, 23, 32), (1, 2, 2, 30, 16), (1, 2, 1, 19, 32), (1, 2, 2, 10, 16)],
)  # fmt: skip
def test_forward_and_backward_match_sdpa(B, Hq, Hkv, S, D, causal):
    q = randn(B, S, Hq, D, seed=1).transpose(1, 2).requires_grad_()  # (B, H, S, D) views, as a model makes
    kv = randn(B, S, 2 * Hkv * D, seed=2)  # k and v: slices of one projection's output
    k = kv[..., : Hkv * D].view(B, S, Hkv, D).transpose(1, 2).detach().requires_grad_()
    v = kv[..., Hkv * D :].view(B, S, Hkv, D).transpose(1, 2).detach().requires_grad_()
    grad = randn(B, Hq, S, D, seed=3)
    out = kernel.attention(q, k, v, D**-0.5, causal)
    out.backward(grad)
    expected, leaves = reference(q, k, v, D**-0.5, causal)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    for got, ref in zip((q, k, v), leaves, strict=True):
        torch.testing.assert_close(got.grad, ref.grad, **TOL[torch.float32])


def test_bf16_and_strided_inputs():
    B, Hq, Hkv, S, D = 2, 6, 2, 128, 32
    q, k, v = (randn(B, H, S, D, seed=s).to(torch.bfloat16).requires_grad_() for s, H in ((1, Hq), (2, Hkv), (3, Hkv)))
    grad = randn(B, Hq, S, D, seed=4).to(torch.bfloat16).transpose(2, 3).contiguous().transpose(2, 3)  # unit stride lost
    out = kernel.attention(q, k, v, 0.2, True)
    assert out.dtype == torch.bfloat16
    out.backward(grad)
    expected, leaves = reference(q, k, v, 0.2, True)
    expected.backward(grad.float())
    torch.testing.assert_close(out.float(), expected, **TOL[torch.bfloat16])
    for got, ref in zip((q, k, v), leaves, strict=True):
        assert got.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.grad.float(), ref.grad, **TOL[torch.bfloat16])


def test_opcheck():
    """torch.library's own checks: schema, fake (meta) functions against real outputs, autograd registration."""
    q, k, v = (randn(2, H, 40, 32, seed=s).requires_grad_() for s, H in ((1, 4), (2, 2), (3, 2)))
    torch.library.opcheck(torch.ops.accelrun.cpu_attention.default, (q, k, v, 0.3, True))
    out, lse = torch.ops.accelrun.cpu_attention(q, k, v, 0.3, True)
    grad = randn(*out.shape, seed=5)
    torch.library.opcheck(torch.ops.accelrun.cpu_attention_backward.default,
                          (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), 0.3, True))  # fmt: skip
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    for mask in (causal[None, None].expand(2, 1, 40, 40), causal & (torch.arange(40) > 0) | torch.eye(40, dtype=torch.bool)):
        torch.library.opcheck(torch.ops.accelrun.cpu_attention_masked.default, (q, k, v, mask, 0.3))
        out, lse = torch.ops.accelrun.cpu_attention_masked(q, k, v, mask, 0.3)
        torch.library.opcheck(torch.ops.accelrun.cpu_attention_masked_backward.default,
                              (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), mask, 0.3))
    seed = torch.tensor(77)
    torch.library.opcheck(torch.ops.accelrun.cpu_attention_dropout.default, (q, k, v, seed, 0.3, True, 0.2))
    out, lse = torch.ops.accelrun.cpu_attention_dropout(q, k, v, seed, 0.3, True, 0.2)
    torch.library.opcheck(torch.ops.accelrun.cpu_attention_dropout_backward.default,
                          (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), seed, 0.3, True, 0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B,Hq,Hkv,S,D,p", [(2, 6, 2, 64, 32, 0.1), (1, 4, 4, 37, 16, 0.5), (1, 2, 1, 19, 48, 0.3)])
def test_dropout_forward_and_backward_match_the_reference(B, Hq, Hkv, S, D, p, causal, dtype):
    """The kernel with dropout against ``_reference`` (torch ops, fp32, fused/dropout.py's numbers for the
    same seed): outputs and gradients, so the forward and the backward drew the same mask."""
    q, k, v = (randn(B, H, S, D, seed=s).to(dtype).requires_grad_() for s, H in ((1, Hq), (2, Hkv), (3, Hkv)))
    seed, grad = torch.tensor(2**50 + 9), randn(B, Hq, S, D, seed=4).to(dtype)
    out, _ = torch.ops.accelrun.cpu_attention_dropout(q, k, v, seed, D**-0.5, causal, p)
    out.backward(grad)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected, _ = kernel._reference(*leaves, D**-0.5, causal, int(seed), p)
    expected.backward(grad.float())
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    for got, ref in zip((q, k, v), leaves, strict=True):
        torch.testing.assert_close(got.grad.float(), ref.grad, **TOL[dtype])
    # Without dropout the reference is SDPA's attention: it is the attention it claims to be.
    plain, _ = kernel._reference(*leaves, D**-0.5, causal, 0, 0.0)
    torch.testing.assert_close(plain, reference(q, k, v, D**-0.5, causal)[0], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("first", [0, 12345, 2**32 - 16, 2**40 + 3])
def test_the_kernels_vector_generator_draws_the_references_numbers(first):
    """``keep_factor`` (GCC vectors) against fused/dropout.py's reference at the same indices, bit for
    bit, across the 2^32 boundary where a lane carries into the index's high half."""
    import ctypes

    from accelrun.compile.fused.dropout import uniform_at

    lib, n, seed, p = kernel._library(torch.float32), 64, 2**61 + 77, 0.3
    got = torch.empty(n)
    lib.attention_keep_factors(seed, first, n, p, ctypes.cast(got.data_ptr(), ctypes.POINTER(ctypes.c_float)))
    keep = uniform_at(torch.tensor(seed), torch.arange(first, first + n)) >= p
    assert torch.equal(got, keep * torch.tensor(1 / (1 - p), dtype=torch.float32))


def test_dropout_drops_at_rate_p_and_each_call_draws_anew():
    q = torch.zeros(2, 4, 64, 16)  # every probability 1/64
    ones = torch.ones(2, 4, 64, 16)  # v of ones: an output row is the kept share of its probabilities / (1 - p)
    torch.manual_seed(0)
    outs = [kernel.attention_dropout(q, q, ones, 0.25, False, 0.5) for _ in range(2)]
    kept = outs[0][..., 0] * 0.5 * 64  # each row's kept count, of 64
    assert torch.equal(kept, kept.round()) and abs(kept.mean().item() - 32) < 5 * (16 / 512) ** 0.5, kept.mean()
    assert not torch.equal(outs[0], outs[1])
    torch.manual_seed(3)
    first = kernel.attention_dropout(q, q, ones, 0.25, False, 0.5)
    torch.manual_seed(3)
    assert torch.equal(kernel.attention_dropout(q, q, ones, 0.25, False, 0.5), first)


def test_supports_names_what_it_declines():
    q = torch.randn(1, 2, 8, 32)
    assert kernel.supports(q, q, q) is None
    assert "dtype" in kernel.supports(q.half(), q.half(), q.half())
    assert "head_dim" in kernel.supports(q[..., :8], q[..., :8], q[..., :8])
    assert "lengths" in kernel.supports(q, q[:, :, :4], q[:, :, :4])
    assert "multiple" in kernel.supports(torch.randn(1, 3, 8, 32), q, q)
    assert "head_dim 0" in kernel.supports(q[..., :0], q[..., :0], q[..., :0])
    assert "pairs for 4 threads" in kernel.supports(q, q, q, threads=4)  # 1 x 2 (batch, head) pairs


def test_the_ops_refuse_what_the_kernel_cannot_compute():
    """Called directly (not through the pass), the ops check the kernel's limits instead of reading past them."""
    for q, k in ((torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24)),  # head_dim not a multiple of 16
                 (torch.randn(1, 3, 8, 32), torch.randn(1, 2, 8, 32)),  # 3 query heads over 2 key/value heads
                 (torch.randn(1, 2, 8, 512), torch.randn(1, 2, 8, 512))):  # head_dim over 256
        with pytest.raises(ValueError, match="cannot take these inputs"):
            kernel.attention(q, k, k, 0.1, True)


# --- the pass -----------------------------------------------------------------------------------


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_repeated(q, k, v):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), scale=0.3)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_pass_routes_sdpa_with_dropout_to_the_kernel_that_drops():
    q = randn(2, 4, 32, 16, seed=0).requires_grad_()
    backend = Fused(["cpu_attention"])
    fn = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.2, is_causal=True),
                       backend=backend, fullgraph=True)  # fmt: skip
    torch.manual_seed(5)
    out = fn(q)
    assert backend.counts == {"cpu_attention": 1} and backend.node(kernel.attention_dropout).args[5] == 0.2
    torch.manual_seed(5)
    torch.testing.assert_close(out, kernel.attention_dropout(q, q, q, 0.25, True, 0.2), rtol=0, atol=0)


@pytest.mark.parametrize("fn,kv_heads", [(sdpa_causal, 6), (sdpa_repeated, 2), (sdpa_gqa, 2)])
@pytest.mark.parametrize("aot", [False, True])
def test_pass_routes_sdpa_to_the_kernel(fn, kv_heads, aot):
    q, k, v = randn(2, 6, 64, 32, seed=0), randn(2, kv_heads, 64, 32, seed=1), randn(2, kv_heads, 64, 32, seed=2)
    backend = run_both(fn, [q, k, v], ["cpu_attention"], aot=aot, tol={"rtol": 1e-5, "atol": 1e-5})
    assert backend.counts == {"cpu_attention": 1}
    call = backend.node(kernel.attention)
    assert [a.op for a in call.args[:3]] == ["placeholder"] * 3  # k and v taken before any repeat
    assert F.scaled_dot_product_attention not in backend.targets()


def heads_of_one_projection(x):
    """q, k and v as a model cuts them from one projection's output ([batch, length, 10 heads, 32]):
    6 query heads, 2 key/value heads."""
    q, k, v = (t.transpose(1, 2) for t in x.split([6, 2, 2], dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _matches_eager_over_lengths(fn, compiled, shape, dim, lengths=(24, 40, 17)):
    """``compiled`` called on inputs of ``shape(length)`` for each length, that axis marked as changing: each
    call at ``fn``'s outputs and input gradients."""
    for n, length in enumerate(lengths):
        x = randn(*shape(length), seed=n)
        eager_x, our_x = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        torch._dynamo.mark_dynamic(our_x, dim)
        expected, got = fn(eager_x), compiled(our_x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        cotangent = randn(*expected.shape, seed=99)
        expected.backward(cotangent)
        got.backward(cotangent)
        torch.testing.assert_close(our_x.grad, eager_x.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aot", [False, True])
def test_a_sequence_length_that_changes_between_calls_runs_the_kernel(aot):
    """Batches of other lengths (a user's data without packing): Dynamo's graph has the length as a
    symbol, and the kernel, which reads its sizes at each call, takes it; one graph for every length,
    eager's outputs and gradients at each. Until 2026-12-05 such calls stayed ATen's ("sizes or
    is_causal not fixed when compiling")."""
    backend = Fused(["cpu_attention"], aot=aot)
    compiled = torch.compile(heads_of_one_projection, backend=backend, fullgraph=True)
    _matches_eager_over_lengths(heads_of_one_projection, compiled, lambda length: (2, length, 10, 32), dim=1)
    assert backend.counts == {"cpu_attention": 1}  # one graph, traced once, for every length
    (x_in,) = [n for n in backend.gm.graph.nodes
               if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)]  # fmt: skip
    assert not isinstance(x_in.meta["example_value"].shape[1], int)  # the length is a symbol there
    assert F.scaled_dot_product_attention not in backend.targets()


def sdpa_mask_built_from_the_length(x):
    """Attention as a user writes it: a boolean causal mask made from the batch's length at each call."""
    q, k, v = (t.transpose(1, 2) for t in x.split([4, 4, 4], dim=2))
    length = x.shape[1]
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("aot", [False, True])
def test_a_mask_made_from_a_changing_length_is_looked_at_when_it_runs(aot):
    """A length that changes between calls (one graph, the length a symbol) and a mask the graph makes
    from it: its values are not known when compiling, so each call looks at them, and the causal one runs
    the kernel, at eager's outputs and gradients. Until 2026-12-06 the call stayed ATen's ("a mask over a
    sequence length not fixed when compiling")."""
    backend = Fused(["cpu_attention"], aot=aot)
    compiled = torch.compile(sdpa_mask_built_from_the_length, backend=backend, fullgraph=True)
    before = dict(kernel.masked_calls)
    _matches_eager_over_lengths(sdpa_mask_built_from_the_length, compiled, lambda length: (2, length, 12, 32), dim=1)
    assert backend.counts == {"cpu_attention": 1}  # one graph for every length
    assert kernel.masked_calls["kernel"] - before["kernel"] == 3 and kernel.masked_calls["aten"] == before["aten"]
    assert F.scaled_dot_product_attention not in backend.targets()


class FunctionalBoolMaskMHA(torch.nn.Module):
    """``F.multi_head_attention_forward`` called directly with a boolean mask over the batch's length,
    where True means masked (``nn.MultiheadAttention`` hands it a float mask instead)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.mha = heads, torch.nn.MultiheadAttention(dim, heads)

    def forward(self, x):  # (T, B, E)
        length, m = x.shape[0], self.mha
        masked = torch.ones(length, length, dtype=torch.bool).triu(1)
        return F.multi_head_attention_forward(x, x, x, x.shape[-1], self.heads, m.in_proj_weight, m.in_proj_bias, None,
                                              None, False, 0.0, m.out_proj.weight, m.out_proj.bias,
                                              training=self.training, need_weights=False, attn_mask=masked)[0]  # fmt: skip


@pytest.mark.parametrize("aot", [False, True])
def test_a_boolean_mask_of_multihead_attention_keeps_its_meaning_once_unfolded(aot):
    """A boolean mask means "masked" to ``F.multi_head_attention_forward`` and "attend" to SDPA: the
    unfolding inverts it, and the causal one runs the kernel at eager's outputs and gradients, over a
    length that changes between calls. Until the review of 2026-12-06 it went to SDPA as it was (every
    output wrong)."""
    torch.manual_seed(0)
    model = FunctionalBoolMaskMHA()
    backend = Fused(["fuse_attention", "cpu_attention"], aot=aot)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    before = dict(kernel.masked_calls)
    _matches_eager_over_lengths(model, compiled, lambda length: (length, 2, 64), dim=0)
    assert backend.counts["cpu_attention"] == 1 and F.multi_head_attention_forward not in backend.targets()
    assert kernel.masked_calls["kernel"] - before["kernel"] == 3 and kernel.masked_calls["aten"] == before["aten"]


def test_a_mask_over_keys_of_changing_length_stays_atens_without_fixing_the_length():
    """Queries of a fixed length, keys of a changing one and a mask: the call stays ATen's, and the pass
    compares no length, which would have added a guard fixing it (Dynamo: "you marked it as dynamic
    but your code specialized it"; the review of 2026-12-05 found that)."""

    def masked(q, kv, m):
        k, v = kv.chunk(2, dim=-1)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m)

    backend = Fused(["cpu_attention"])
    compiled = torch.compile(masked, backend=backend, fullgraph=True)
    for length in (4, 12, 20):
        q, kv, m = randn(2, 4, 4, 32, seed=1), randn(2, length, 4, 64, seed=2), torch.zeros(4, length)
        torch._dynamo.mark_dynamic(kv, 1)
        torch._dynamo.mark_dynamic(m, 1)
        torch.testing.assert_close(compiled(q, kv, m), masked(q, kv, m), rtol=1e-5, atol=1e-5)
    assert backend.counts == {"cpu_attention": 0}


def test_pass_leaves_what_the_kernel_does_not_take():
    q = randn(2, 4, 16, 32)

    def masked(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    cases = [(masked, [q, q, q, randn(16, 16, seed=3).requires_grad_()]), (sdpa_causal, [q[..., :8]] * 3),
             (sdpa_causal, [q.half()] * 3)]  # fmt: skip
    for fn, inputs in cases:
        backend = Fused(["cpu_attention"])
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
        assert backend.counts == {"cpu_attention": 0}
        assert F.scaled_dot_product_attention in backend.targets()


def test_llama_block_runs_the_kernel_with_eager_gradients():
    """The project's block (grouped-query attention through repeat_kv) with every fusion pass, through
    AOTAutograd: one kernel call, no repeated K/V left, outputs and gradients equal eager's."""
    args = LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64, max_seq_len=32)
    torch.manual_seed(0)
    block = TransformerBlock(args)
    block.init_weights(0.02, 0.02)
    cos, sin = rope_tables(args.head_dim, 32, args.rope_theta)
    x = randn(2, 32, args.dim)
    x_eager, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = block(x_eager, cos, sin)
    expected.square().sum().backward()
    eager_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    backend = Fused(FUSION_PASSES, aot=True)
    got = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)(x_fused, cos, sin)
    got.square().sum().backward()
    assert backend.counts["cpu_attention"] == 1
    assert not any(n.target == "repeat_interleave" for n in backend.gm.graph.nodes)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(x_fused.grad, x_eager.grad, **tol)
    for name, p in block.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], **tol, msg=name)


def test_a_kernel_that_cannot_be_built_leaves_attention_to_aten(refusing_compiler, monkeypatch):
    """A compiler that refuses the source (found on the PATH, so the pass took the call): the ops warn once
    and compute with ATen, in the kernel's layout, instead of failing the run."""
    monkeypatch.setattr(kernel.LIBRARY, "_built", {})  # this process's built library is put back afterwards
    q, k, v = (randn(2, H, 24, 32, seed=s).requires_grad_() for s, H in ((1, 4), (2, 2), (3, 2)))
    with pytest.warns(UserWarning, match="could not be built"):
        out = kernel.attention(q, k, v, 0.2, True)
    assert "RuntimeError" in kernel.LIBRARY.failure(torch.float32)
    grad = randn(*out.shape, seed=4)
    out.backward(grad)
    expected, leaves = reference(q, k, v, 0.2, True)
    expected.backward(grad)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert out.transpose(1, 2).is_contiguous()  # the layout the fake function promised
    for got, ref in zip((q, k, v), leaves, strict=True):
        torch.testing.assert_close(got.grad, ref.grad, **TOL[torch.float32])
    # With dropout the ops compute the reference (the same masks the kernel would draw), in its layout;
    # its written-out backward against autograd's of the reference.
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(2)
    dropped = kernel.attention_dropout(q, k, v, 0.2, True, 0.3)
    dropped.backward(grad)
    torch.manual_seed(2)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected, _ = kernel._reference(*leaves, 0.2, True, int(torch.randint(0, 2**62, ())), 0.3)
    expected.backward(grad)
    torch.testing.assert_close(dropped, expected, **TOL[torch.float32])
    assert dropped.transpose(1, 2).is_contiguous()
    for got, ref in zip((q, k, v), leaves, strict=True):
        torch.testing.assert_close(got.grad, ref.grad, **TOL[torch.float32])


def test_the_kernel_build_starts_before_tracing_for_the_dtype_attention_will_run_in(monkeypatch):
    """The graph cache calls ``before_tracing`` ahead of Dynamo: a module whose own code calls SDPA on the
    CPU starts the kernel's build then, for autocast's dtype when it is on; others start nothing."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions
    from accelrun.compile.passes.base import resolve_passes
    from accelrun.compile.passes.cpu_attention import build_kernel_early

    started: list[torch.dtype] = []
    monkeypatch.setattr(kernel, "build_in_background", started.append)
    monkeypatch.setattr(kernel, "find_compiler", lambda: "g++")
    block = TransformerBlock(LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=128))
    build_kernel_early(block)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        build_kernel_early(block)
    build_kernel_early(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))  # no attention
    build_kernel_early(torch.nn.MultiheadAttention(16, 2))  # SDPA inside torch's functional code: not seen
    assert started == [torch.float32, torch.bfloat16]
    transformers = pytest.importorskip("transformers")
    hf = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64)  # fmt: skip
    for implementation, expected in (("sdpa", [torch.float32]), ("eager", [])):
        started.clear()
        config = transformers.LlamaConfig(**hf, attn_implementation=implementation)
        build_kernel_early(transformers.LlamaForCausalLM(config))  # its attention picks SDPA from a table
        assert started == expected, implementation
    started.clear()
    AccelrunBackend(CompileOptions(passes=resolve_passes("default"))).before_tracing(block)
    AccelrunBackend(CompileOptions(passes=[p for p in resolve_passes("default")
                                           if p.name != "cpu_attention"])).before_tracing(block)  # fmt: skip
    assert started == [torch.float32]


def sdpa_built_causal_mask(q, k, v):
    """A causal mask built from aranges, as transformers builds one under torch.compile."""
    pos = torch.arange(q.shape[-2])
    mask = (pos[None, :] <= pos[:, None])[None, None].expand(q.shape[0], 1, -1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_built_window_mask(q, k, v):
    pos = torch.arange(q.shape[-2])
    mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 4)  # sliding window: not causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])


def sdpa_tril_mask(q, k, v):
    """A user's 2-D causal mask: ``torch.ones(T, T, dtype=torch.bool).tril()``, broadcast by SDPA."""
    T = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(T, T, dtype=torch.bool).tril())


def sdpa_additive_2d_mask(q, k, v):
    """The additive form: 0 on and below the diagonal, -inf above (``generate_square_subsequent_mask``)."""
    T = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.triu(torch.full((T, T), float("-inf")), 1))


def sdpa_input_mask(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def test_a_causal_mask_computed_from_numbers_is_the_kernels_causal_flag():
    """The mask is evaluated at compile time; only the causal one is taken (and dropped), at SDPA's
    results. A window mask stays with ATen; a mask given as an input (its values unknown) goes to
    ``cpu_attention_masked`` (next test)."""
    q, k, v = randn(2, 4, 16, 32, seed=0), randn(2, 4, 16, 32, seed=1), randn(2, 4, 16, 32, seed=2)
    backend = run_both(sdpa_built_causal_mask, [q, k, v], ["cpu_attention"], aot=True,
                       tol={"rtol": 1e-5, "atol": 1e-5})  # fmt: skip
    assert backend.counts == {"cpu_attention": 1}
    assert backend.node(kernel.attention).args[4] is True  # is_causal
    assert F.scaled_dot_product_attention not in backend.targets()
    backend = Fused(["cpu_attention"])
    torch.compile(sdpa_built_window_mask, backend=backend, fullgraph=True)(q, k, v)
    assert backend.counts == {"cpu_attention": 0}
    assert F.scaled_dot_product_attention in backend.targets()


@pytest.mark.parametrize("fn", [sdpa_tril_mask, sdpa_additive_2d_mask])
def test_a_two_dimensional_causal_mask_computed_from_numbers_is_the_causal_flag(fn):
    """A (T, T) mask, boolean or additive, as users write one: taken as causal like transformers'
    (B, 1, T, T) one. Both were left to ATen as "a mask other than the causal one" (found by a new
    user's model: 14% of its step)."""
    q, k, v = randn(2, 4, 16, 32, seed=0), randn(2, 4, 16, 32, seed=1), randn(2, 4, 16, 32, seed=2)
    backend = run_both(fn, [q, k, v], ["cpu_attention"], aot=True, tol={"rtol": 1e-5, "atol": 1e-5})
    assert backend.counts == {"cpu_attention": 1}
    assert backend.node(kernel.attention).args[4] is True  # is_causal


@pytest.mark.parametrize("kind", ["causal bool", "causal additive", "padding"])
def test_a_mask_given_as_an_input_is_looked_at_when_it_runs(kind):
    """transformers' Falcon builds its causal mask outside its blocks and passes it in: its values are
    unknown when compiling. The causal one runs the kernel; any other runs ATen's flash attention with
    the mask (as eager does); both at SDPA's results and gradients, through AOTAutograd."""
    q, k, v = randn(2, 4, 16, 32, seed=0), randn(2, 4, 16, 32, seed=1), randn(2, 4, 16, 32, seed=2)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    mask = causal[None, None].expand(2, 1, 16, 16)  # broadcast over the batch, as Falcon's is
    if kind == "padding":
        mask = mask & (torch.arange(16) >= 3)
        mask[..., 0] = True  # every query keeps a key (a row of -inf alone is NaN in every kernel)

    def additive(q, k, v, m):  # 0 where allowed, the dtype's lowest elsewhere, made from the input
        return sdpa_input_mask(q, k, v, torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min))

    fn = additive if kind == "causal additive" else sdpa_input_mask
    before = dict(kernel.masked_calls)
    backend = run_both(fn, [q, k, v, mask], ["cpu_attention"], aot=True, tol={"rtol": 1e-5, "atol": 1e-5})
    assert backend.counts == {"cpu_attention": 1}
    assert backend.node(kernel.attention_masked) is not None and F.scaled_dot_product_attention not in backend.targets()
    ran = {where: kernel.masked_calls[where] - before[where] for where in before}
    assert ran == ({"kernel": 1, "aten": 0} if kind.startswith("causal") else {"kernel": 0, "aten": 1}), ran


# (autocast dtype, loss rtol, gradient rtol, gradient atol as a share of the largest): bf16's rounding
LLAMA_TOLERANCES = {None: (1e-5, 1e-4, 1e-5), torch.bfloat16: (1e-2, 5e-2, 2e-2)}


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_transformers_llama_runs_the_kernel_with_eager_gradients(tmp_path, autocast):
    """transformers' Llama under torch.compile builds its causal mask from aranges and passes it to
    SDPA (in eager it passes none and is_causal=True); each layer's attention now runs the kernel, at
    eager's loss and gradients. Under bf16 autocast its RoPE leaves queries and keys in fp32 while the
    values are bf16, and autocast casts all three to bf16 for SDPA: the pass had left that to ATen
    ("dtype torch.float32", the wrong reason; a new user's Qwen2 ran bf16 at 1.10x eager against 1.30x
    in fp32), and now casts them as autocast does."""
    transformers = pytest.importorskip("transformers")
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    reference = transformers.LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"], cache_dir=tmp_path))
    cast = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with cast:
        loss = torch.compile(model, backend=backend)(input_ids=ids, labels=ids, use_cache=False).loss
        expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    expected.backward()
    loss_rtol, grad_rtol, grad_atol = LLAMA_TOLERANCES[autocast]
    torch.testing.assert_close(loss, expected, rtol=loss_rtol, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=grad_rtol, atol=grad_atol * q.grad.abs().max().item(), msg=name)
    summaries = [r.summary for r in backend.record.passes if r.name == "cpu_attention"]
    assert summaries and all(s.startswith("2 attention calls") for s in summaries), summaries


def test_attention_on_inputs_of_several_dtypes_outside_autocast_is_left_to_aten_saying_so():
    q, k, v = randn(1, 2, 16, 16, seed=0), randn(1, 2, 16, 16, seed=1), randn(1, 2, 16, 16, seed=2).bfloat16()
    assert kernel.shape_problem(q, k, v) == ("queries, keys and values of dtypes torch.float32, torch.float32, "
                                             "torch.bfloat16 (one dtype for all three)")


def test_transformers_falcon_blocks_run_the_kernel_on_the_mask_they_are_given(tmp_path):
    """transformers' Falcon always builds its causal mask before its decoder layers (so that ALiBi can be
    added) and hands it to each one. Compiled as `accelrun train` compiles a user's model (its repeated
    blocks), each layer's attention got the mask as an input, stayed with ATen, and the run was slower
    than eager (0.90x, found by a walk). Now each call looks at the mask, runs the kernel, and the loss
    and gradients are eager's."""
    transformers = pytest.importorskip("transformers")
    from accelrun.compile.compile_model import compile_model
    from accelrun.config.schema import CompileConfig
    from accelrun.models.build import training_loss_fn

    config = transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model, reference = transformers.FalconForCausalLM(config), transformers.FalconForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    torch._dynamo.reset()
    compiled = compile_model(model, None, CompileConfig(backend="accelrun", executors=["cpp", "aten"],
                                                        graph_cache=False), precision="fp32")  # fmt: skip
    before = dict(kernel.masked_calls)
    loss = training_loss_fn(model)(inputs, targets)
    loss.backward()
    expected = training_loss_fn(reference)(inputs, targets)
    expected.backward()
    assert kernel.masked_calls["kernel"] - before["kernel"] == 2 and kernel.masked_calls["aten"] == before["aten"]
    assert compiled.record.dynamo_graphs == 1  # both blocks, one graph
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * q.grad.abs().max().item(), msg=name)


def test_the_report_names_attention_left_to_aten_and_why():
    """`compile explain` said why (dropout with a mask, here); the run's report said nothing (found by a walk)."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.report.markdown import _compiler_section

    backend = AccelrunBackend()
    q = randn(2, 4, 16, 32, seed=0).requires_grad_()
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    torch.compile(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m, dropout_p=0.1),
                  backend=backend)(q, mask).sum().backward()  # fmt: skip
    assert backend.record.attention_left_to_aten() == {"dropout with a mask": 1}
    assert "- attention left to ATen's kernel (1 call(s) in the graphs): dropout with a mask" in _compiler_section(
        backend.record.summary())


def test_attention_off_the_cpu_is_not_reported_as_left_to_aten():
    # A GPU's attention is not the CPU pass's to take: it must not fill every GPU report with "left to ATen".
    from accelrun.compile.passes.base import PassContext, resolve_passes

    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    q = torch.empty(2, 4, 16, 32, device="meta")
    torch.compile(sdpa_causal, backend=capture, fullgraph=True)(q, q, q)
    ((gm, inputs),) = graphs
    (p,) = resolve_passes(["cpu_attention"])
    assert p.spec.fn(gm, p.options, PassContext("pre_grad", list(inputs))).counts == {"matched": 0}
    q = torch.empty(2, 4, 16, 32)  # the same call on the CPU with dropout and a mask: left, and why
    graphs.clear()
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    torch.compile(lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m, dropout_p=0.1),
                  backend=capture)(q, mask)  # fmt: skip
    ((gm, inputs),) = graphs
    assert p.spec.fn(gm, p.options, PassContext("pre_grad", list(inputs))).counts == {
        "matched": 0, "left to ATen: dropout with a mask": 1}


def meta_llama_attention(q, k, v, keep):
    """Meta's Llama code: an fp32 additive mask (built outside the layers, here from an input) added to
    half scores, the softmax upcast and cast back."""
    mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    scores = torch.matmul(q, k.transpose(2, 3)) / q.shape[-1] ** 0.5 + mask
    return torch.matmul(F.softmax(scores.float(), dim=-1).type_as(q), v)


def test_an_fp32_mask_on_half_scores_is_fused_and_runs_the_kernel():
    """bf16 scores plus an fp32 mask are fp32, so the mask had to be q's dtype to match: bf16-mixed
    runs of such a model fused no attention, with no word (found by a walk)."""
    q, k, v = (randn(2, 4, 32, 32, seed=s, dtype=torch.bfloat16) for s in (0, 1, 2))
    keep = torch.ones(32, 32, dtype=torch.bool).tril()
    before = dict(kernel.masked_calls)
    backend = run_both(meta_llama_attention, [q, k, v, keep], ["fuse_attention", "cpu_attention"], aot=True)
    assert backend.counts == {"fuse_attention": 1, "cpu_attention": 1}
    assert kernel.masked_calls["kernel"] - before["kernel"] == 1


def test_keys_and_values_of_a_changing_length_say_why_they_are_left_to_aten():
    """q, k and v of one length per call, traced as separate symbols: the reason read "q, k and v disagree
    on batch or head_dim", which they do not (a fuzzer's)."""
    from accelrun.compile.backend import AccelrunBackend
    from accelrun.compile.options import CompileOptions

    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"]))
    attend = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), backend=backend,
                           fullgraph=True)  # fmt: skip
    for length in (5, 9, 3):
        q, k, v = (torch.randn(1, 2, length, 16, requires_grad=True) for _ in range(3))
        attend(q, k, v).sum().backward()
    reasons = backend.record.attention_left_to_aten()
    assert reasons and not any("disagree on batch" in r for r in reasons), reasons
    assert any("are symbols not known equal when compiling" in r for r in reasons), reasons

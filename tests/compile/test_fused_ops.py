"""The fused ops against the eager code they replace: forward values, gradients, gradcheck, memory."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from accelrun.compile.fused import linear_cross_entropy, rms_norm, rope, swiglu
from accelrun.models.families.llama.model import apply_rope, rope_tables

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


def _leaves(inputs, dtype):
    return [
        t.detach().to(dtype if t.is_floating_point() else t.dtype).requires_grad_(t.is_floating_point())
        for t in inputs
    ]


def assert_same_as_eager(reference, fused, inputs, dtype, seed=0):
    """Forward outputs and every input's gradient agree (fp32 tight, bf16 to bf16's precision)."""
    a, b = _leaves(inputs, dtype), _leaves(inputs, dtype)
    out_a, out_b = reference(*a), fused(*b)
    assert out_a.dtype == out_b.dtype and out_a.shape == out_b.shape
    torch.testing.assert_close(out_b, out_a, **TOL[dtype])
    grad = torch.randn(out_a.shape, generator=torch.Generator().manual_seed(seed)).to(out_a.dtype)
    out_a.backward(grad)
    out_b.backward(grad)
    for x, y in zip(a, b, strict=True):
        if x.requires_grad:
            assert y.grad.dtype == x.grad.dtype
            torch.testing.assert_close(y.grad, x.grad, **TOL[dtype])


def llama_rmsnorm(x, w, eps=1e-5):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llama(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 16, generator=g), torch.randn(16, generator=g)
    assert_same_as_eager(llama_rmsnorm, lambda x, w: rms_norm(x, w, 1e-5, upcast=True, cast_back=True), [x, w], dtype)


def test_rms_norm_without_weight_or_casts():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))

    def reference(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    assert_same_as_eager(reference, lambda x: rms_norm(x, None, 1e-6), [x], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu(dtype):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    assert_same_as_eager(lambda a, b: F.silu(a) * b, swiglu, [a, b], dtype)


def test_swiglu_broadcast():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
    assert_same_as_eager(lambda a, b: F.silu(a) * b, swiglu, [a, b], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_apply_rope(dtype):
    cos, sin = rope_tables(8, 6, 10000.0)
    x = torch.randn(2, 6, 3, 8, generator=torch.Generator().manual_seed(4))
    assert_same_as_eager(
        lambda x: apply_rope(x, cos, sin),
        lambda x: rope(x, cos[:, None, :], sin[:, None, :], upcast=True, cast_back=True),
        [x],
        dtype,
    )


def _eager_linear_ce(h, w, b, t, ignore_index=-100, reduction="mean"):
    logits = F.linear(h, w, b).float()
    return F.cross_entropy(logits.flatten(0, -2), t.flatten(), ignore_index=ignore_index, reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy(dtype, reduction):
    g = torch.Generator().manual_seed(5)
    h, w, b = torch.randn(2, 7, 16, generator=g), torch.randn(11, 16, generator=g), torch.randn(11, generator=g)
    t = torch.randint(0, 11, (2, 7), generator=g)
    t[0, :3] = -1  # ignored rows, split across chunks

    def reference(h, w, b):
        return _eager_linear_ce(h, w, b, t, -1, reduction)

    def fused(h, w, b):
        return linear_cross_entropy(h, w, b, t, ignore_index=-1, reduction=reduction, chunk_rows=4)

    assert_same_as_eager(reference, fused, [h, w, b], dtype)


def test_linear_cross_entropy_bad_arguments():
    h, w, t = torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, None, t, reduction="none")
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(h, w, None, t, chunk_rows=0)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(6)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (r(3, 6), r(6)))
    assert torch.autograd.gradcheck(swiglu, (r(3, 6), r(3, 6)))
    # cos/sin need grad too here, which exercises their (rarely used) gradient formulas.
    assert torch.autograd.gradcheck(lambda x, c, s: rope(x, c, s), (r(2, 3, 6), r(3, 3), r(3, 3)))
    t = torch.tensor([0, 3, -100, 2, 1])
    assert torch.autograd.gradcheck(
        lambda h, w, b: linear_cross_entropy(h, w, b, t, chunk_rows=2, upcast=False), (r(5, 4), r(4, 4), r(4))
    )


class PeakMemory(TorchDispatchMode):
    """Peak bytes of live tensor storages created while active (CPU or any device)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._seen:
                    self._seen.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, nbytes)
        return out


def test_linear_cross_entropy_never_holds_the_logits():
    rows, dim, vocab = 512, 32, 2048
    g = torch.Generator().manual_seed(7)
    h = torch.randn(rows, dim, generator=g, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (rows,), generator=g)
    logits_bytes = rows * vocab * 4

    peaks = {}
    for name, loss_fn in {
        "eager": lambda: _eager_linear_ce(h, w, None, t),
        "fused": lambda: linear_cross_entropy(h, w, None, t, chunk_rows=64),
    }.items():
        h.grad = w.grad = None
        with PeakMemory() as memory:
            loss_fn().backward()
        peaks[name] = memory.peak
    assert peaks["eager"] >= logits_bytes  # the full logits existed
    assert peaks["fused"] < logits_bytes  # one 64-row chunk of them at a time, plus the gradients
    assert peaks["fused"] < peaks["eager"] / 3


def _saved_by_forward(fn, *inputs):
    """The tensors AOTAutograd's forward graph hands to the backward (outputs past the real ones)."""
    saved = {}

    def fw_compiler(gm, _):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved["shapes"] = [tuple(n.meta["val"].shape) for n in out[1:]]
        return make_boxed_func(gm.forward)

    compiled = aot_function(fn, fw_compiler=fw_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    compiled(*inputs).sum().backward()
    return saved["shapes"]


def test_backward_saves_what_the_docs_say():
    # Traced by AOTAutograd (as the compiler backend does), the forward keeps only the promised tensors.
    x, w = torch.randn(4, 8, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    assert sorted(_saved_by_forward(lambda x, w: rms_norm(x, w, 1e-5, True, True), x, w)) == [
        (4, 8, 1), (4, 8, 16), (16,)
    ]  # fmt: skip
    a, b = torch.randn(4, 32, requires_grad=True), torch.randn(4, 32, requires_grad=True)
    assert _saved_by_forward(swiglu, a, b) == [(4, 32), (4, 32)]
    cos, sin = (t[:, None, :] for t in rope_tables(16, 8, 10000.0))
    xq = torch.randn(2, 8, 3, 16, requires_grad=True)
    saved = _saved_by_forward(lambda x, c, s: rope(x, c, s, True, True), xq, cos, sin)
    assert saved and all(shape == (8, 1, 8) for shape in saved)  # cos and sin only, never x
    h, wo = torch.randn(64, 16, requires_grad=True), torch.randn(100, 16, requires_grad=True)
    t = torch.randint(0, 100, (64,))
    saved = _saved_by_forward(lambda h, w, t: linear_cross_entropy(h, w, None, t, chunk_rows=16), h, wo, t)
    assert saved and all(torch.Size(s).numel() != 64 * 100 for s in saved)  # no (N, V) tensor survives


@pytest.mark.parametrize("autocast", [False, True])
def test_the_compiled_head_and_loss_sums_the_weight_gradient_in_place(tmp_path, autocast):
    """Compiled as a training step runs it, the fused head and loss over many chunks. The weight's
    gradient was summed out of place, and the regions partitioner made the sums of all chunks one
    region at the end, which held every chunk's part until then: a step's peak 13.8x its gradients'
    size here in fp32 (152 MiB against 56 at 8 chunks of a 4,096 x 8,192 head), 7.3x under autocast.
    Summed in place (fp32), and no region kept from running where its inputs die (autocast's bf16
    parts), the peak is the gradients and one chunk's work."""
    from accelrun.compile.backend import AccelrunBackend, CompileOptions
    from accelrun.compile.passes.base import resolve_passes
    from accelrun.report.allocator_peak import allocator_peak

    rows, dim, vocab, chunk = 1024, 256, 4096, 64
    passes = [{p.spec.name: {"chunk_rows": chunk}} if p.spec.name == "fuse_linear_cross_entropy" else p.spec.name
              for p in resolve_passes("default")]
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(passes), executors=["cpp", "aten"],
                                             cache_dir=tmp_path))  # fmt: skip

    def head_and_loss(h, w, t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return F.cross_entropy(F.linear(h, w).float(), t)

    g = torch.Generator().manual_seed(3)
    h = torch.randn(rows, dim, generator=g, requires_grad=True)
    w = (0.02 * torch.randn(vocab, dim, generator=g)).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    compiled = torch.compile(head_and_loss, backend=backend)
    compiled(h, w, t).backward()  # compiles
    h.grad = w.grad = None
    with allocator_peak() as peak:
        loss = compiled(h, w, t)
        loss.backward()
    assert backend.record.summary()["passes_fired"].get("fuse_linear_cross_entropy") == 1
    grads = (vocab * dim + rows * dim) * 4  # the gradients the step hands back (fp32)
    # The forward's own (V, D) fp32 sum and (N, D) input gradient, beside those: twice the gradients,
    # one chunk's logits and their work (4 bytes x 4 per logit), and under autocast the weight's bf16
    # copy and a chunk's bf16 part of its gradient.
    bound = 2 * grads + 16 * chunk * vocab + (2 * 2 * vocab * dim if autocast else 0)
    assert peak.bytes <= bound, (peak.bytes / grads, bound / grads)
    h_ref, w_ref = h.detach().requires_grad_(), w.detach().requires_grad_()
    ref = head_and_loss(h_ref, w_ref, t)
    ref.backward()
    tol = TOL[torch.bfloat16 if autocast else torch.float32]
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(w.grad, w_ref.grad, **tol)
    torch.testing.assert_close(h.grad, h_ref.grad, **tol)
    torch._dynamo.reset()


def test_under_autocast_the_fused_loss_is_fp32_as_eagers():
    """Autocast runs cross_entropy in fp32 on bf16 logits, with no cast in the user's code: the fused loss
    came back in bf16 (4.71875 against eager's 4.7232, a fuzzer's)."""
    from accelrun.compile.backend import AccelrunBackend, CompileOptions

    def loss_of(x, w, t):
        return F.cross_entropy((x @ w.t()).view(-1, 50), t.view(-1))

    g = torch.Generator().manual_seed(0)
    x, w, t = torch.randn(2, 5, 32, generator=g), 0.3 * torch.randn(50, 32, generator=g), torch.randint(0, 50, (2, 5))
    backend = AccelrunBackend(CompileOptions(executors=["cpp", "aten"]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = loss_of(x, w, t), torch.compile(loss_of, backend=backend, fullgraph=True)(x, w, t)
    assert backend.record.summary()["passes_fired"].get("fuse_linear_cross_entropy") == 1
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

"""loss_row_stats: cross-entropy's log-softmax is saved as two row statistics, its input recomputing
it in the backward; losses and gradients stay eager's (fp32 rtol 1e-5, bf16 rtol 1e-2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accelrun.compile.backend import AccelrunBackend
from accelrun.compile.options import CompileOptions
from accelrun.compile.passes.base import resolve_passes


def _compiled(fn, tmp_path, passes="default", dump_dir=None):
    torch._dynamo.reset()
    backend = AccelrunBackend(CompileOptions(passes=resolve_passes(passes), executors=["cpp", "aten"],
                                             cache_dir=tmp_path, dump_dir=dump_dir))  # fmt: skip
    return torch.compile(fn, backend=backend), backend.record


def _fired(record) -> list:
    return [p for p in record.passes if p.name == "loss_row_stats"]


def _head(x, w, targets):
    logits = x @ w.t()
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100), logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_saves_row_statistics_and_matches_eager(tmp_path, dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(40, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 40, (2, 8))
    targets[0, 3] = -100  # an ignored position: no loss, no gradient
    fn, record = _compiled(_head, tmp_path)
    got_loss, got_logits = fn(x, w, targets)
    (got_loss + got_logits.float().sum() * 1e-3).backward()
    got = [got_loss.detach(), x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    want_loss, want_logits = _head(x, w, targets)
    (want_loss + want_logits.float().sum() * 1e-3).backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for g, e in zip(got, [want_loss.detach(), x.grad, w.grad], strict=True):
        torch.testing.assert_close(g, e, **tol)
    (fired,) = _fired(record)
    assert fired.counts.get("log_softmax") == 1, fired.summary
    assert not record.fallbacks


def test_bf16_logits_flattened_after_their_upcast_are_saved_as_they_are(tmp_path):
    """transformers writes ``logits.float().view(-1, vocab)``: the backward recomputes the upcast from
    the bf16 logits (saved anyway: the model returns them) instead of keeping an fp32 copy of them."""
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    fn, record = _compiled(_head, tmp_path, dump_dir=tmp_path / "dump")
    loss, logits = fn(x, w, torch.randint(0, 40, (2, 8)))
    loss.backward()
    (dumped,) = (tmp_path / "dump" / "g0.backward").glob("*_input.py")  # numbered after the partition's remat
    text = dumped.read_text()
    saved = text[text.index("def forward(") :].split(":\n", 1)[0]  # the backward's inputs
    assert "bf16[16, 40]" in saved and "f32[16, 40]" not in saved, saved
    (fired,) = _fired(record)
    assert fired.counts.get("log_softmax") == 1 and not record.fallbacks


def test_a_log_softmax_the_forward_returns_is_left_alone(tmp_path):
    """Its whole output is needed in the forward: saving it costs nothing more, nothing is rewritten."""
    x = torch.randn(6, 40, requires_grad=True)
    fn, record = _compiled(lambda a: F.log_softmax(a * 2, -1), tmp_path)
    out = fn(x)
    out.sum().backward()
    got = x.grad.clone()
    x.grad = None
    F.log_softmax(x * 2, -1).sum().backward()
    torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-6)
    (fired,) = _fired(record)
    assert not fired.counts.get("log_softmax"), fired.summary


def test_the_pass_is_off_with_passes_none(tmp_path):
    fn, record = _compiled(_head, tmp_path, passes="none")
    loss, _ = fn(torch.randn(2, 8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True),
                 torch.randint(0, 40, (2, 8)))
    loss.backward()
    assert not _fired(record)

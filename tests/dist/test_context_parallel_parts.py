"""Context parallelism's parts in one process: the chunk layout, the sharded attention against plain
causal attention (the all-gather replaced by the concatenation it performs), the loss rescaling,
and the recipe rules (exit 2 naming the keys). The multi-rank jobs are in test_dist_context_parallel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accelrun.config import ConfigError, load_config
from accelrun.config.validate import CP_FAMILIES
from accelrun.dist import context_parallel as cpmod
from accelrun.models.families import family_names, get_family
from accelrun.models.families.llama.model import repeat_kv
from accelrun.models.sequence_chunks import chunk_positions, sequence_from_rank_chunks, take_local_chunks
from tests.conftest import DEFAULT_CONFIG, TINY


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_ranks_chunks_cover_the_sequence_once_and_reassemble(cp):
    T = 12 * cp
    x_BT = torch.arange(2 * T).view(2, T)
    locals_ = [take_local_chunks(x_BT, r, cp) for r in range(cp)]
    for r, x in enumerate(locals_):
        assert x.shape == (2, T // cp)
        assert torch.equal(x[0], chunk_positions(T // cp, r, cp))  # row 0 holds the positions themselves
    positions = torch.cat([chunk_positions(T // cp, r, cp) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(T))
    # Ranks stacked (cp, B, 2, c) → the whole sequence in order.
    stacked = torch.stack([x.unflatten(1, (2, -1)) for x in locals_])
    assert torch.equal(sequence_from_rank_chunks(stacked, seq_dim=2), x_BT)


@pytest.mark.parametrize("cp", [2, 3])
def test_sharded_attention_equals_causal_attention(cp, monkeypatch):
    torch.manual_seed(0)
    B, H, G, T, E = 2, 4, 2, 12 * cp, 8
    q, k, v = torch.randn(B, H, T, E), torch.randn(B, G, T, E), torch.randn(B, G, T, E)
    want = F.scaled_dot_product_attention(q, repeat_kv(k, H), repeat_kv(v, H), is_causal=True)

    def local(x, r):
        return take_local_chunks(x, r, cp, dim=2)

    # What each rank contributes to the gather: (2, B, G, 2, c, E); the collective concatenates them on dim 0.
    sent = [torch.stack([local(k, r), local(v, r)]).unflatten(3, (2, -1)) for r in range(cp)]
    gathers = []

    def fake_all_gather(x, dim, group):
        gathers.append(x.shape)
        return torch.cat(sent, dim=0)

    monkeypatch.setattr(cpmod, "_all_gather", fake_all_gather)
    stats = cpmod.ContextParallelStats()
    for r in range(cp):
        attn = cpmod.LoadBalancedCausalAttention(None, r, cp, stats)
        got = attn(local(q, r), local(k, r), local(v, r))
        torch.testing.assert_close(got, local(want, r), rtol=1e-5, atol=1e-6)
    assert len(gathers) == cp and stats.calls == cp
    assert stats.step_metrics()["cp_bytes"] == cp * sent[0].numel() * 4 * (cp - 1)
    assert stats.step_metrics() == {}  # per step: nothing since (all in compiled graphs, or none)


def test_loss_is_rescaled_to_the_whole_sequences_mean(monkeypatch):
    """Two cp ranks with 3 and 1 counted targets: each returns its tokens' sum × cp / 4, so their mean
    (what FSDP and the loop average) is the mean over the 4 counted tokens."""
    counts = {0: 3, 1: 1}
    monkeypatch.setattr(cpmod.dist, "all_reduce", lambda t, group=None: t.fill_(sum(counts.values())))
    monkeypatch.setattr(cpmod, "to_collective_device", lambda t, group: t)
    values = {0: torch.tensor([1.0, 2.0, 3.0]), 1: torch.tensor([10.0])}
    out = []
    for r in (0, 1):
        targets = torch.tensor([[5] * counts[r] + [cpmod.IGNORE_INDEX] * (4 - counts[r])])
        fn = cpmod.context_parallel_loss(lambda i, t, r=r: values[r].mean(), None, 2)
        out.append(fn(None, targets))
    assert (out[0] + out[1]) / 2 == pytest.approx((1 + 2 + 3 + 10) / 4)


def test_families_with_a_sequence_hook_are_the_ones_validate_names():
    assert sorted(n for n in family_names() if get_family(n).shard_sequence is not None) == sorted(CP_FAMILIES)


@pytest.mark.parametrize("overrides, keys", [
    (["train.seq_len=30"], ["train.seq_len = 30", "parallel.cp = 2"]),
    (["model.custom=mypkg.model:build"], ["parallel.cp = 2", "model.custom"]),
    (["parallel.pp=2", "parallel.nproc_per_node=4"], ["parallel.cp = 2", "parallel.pp = 2"]),
    (["parallel.dp_shard=1", "parallel.tp=2", "parallel.nproc_per_node=4", "parallel.loss_parallel=true"],
     ["parallel.cp = 2", "parallel.loss_parallel = True"]),
])
def test_refused_layouts_exit_2_naming_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT_CONFIG, [*TINY, "parallel.nproc_per_node=2", "parallel.cp=2", *overrides])
    assert e.value.exit_code == 2
    message = " ".join(e.value.messages)
    assert all(k in message for k in keys), message


@pytest.mark.parametrize("chunk", [0, 1, 3])
def test_prefix_causal_attention_matches_masked_sdpa_forward_and_backward(chunk):
    """The CPU path (two flash calls merged by log-sum-exp, a hand-written backward) against SDPA with
    the lower-right causal mask it avoids materialising."""
    from accelrun.dist.blockwise_attention import prefix_causal_attention

    torch.manual_seed(1)
    B, H, G, c, E = 2, 4, 2, 8, 16  # grouped: 2 key/value heads, repeated inside
    T = 4 * c
    q = torch.randn(B, H, c, E, requires_grad=True)
    k, v = torch.randn(B, G, T, E, requires_grad=True), torch.randn(B, G, T, E, requires_grad=True)
    end = (chunk + 1) * c
    mask = torch.ones(c, end, dtype=torch.bool).tril(chunk * c)
    want = F.scaled_dot_product_attention(q, repeat_kv(k, H)[:, :, :end], repeat_kv(v, H)[:, :, :end], attn_mask=mask)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    got = prefix_causal_attention(q, k, v, chunk)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)

"""The Llama model: shapes, causality, attention and rotary maths, meta-device build, initialisation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accelrun.models import Llama, LlamaArgs, TransformerBlock
from accelrun.models.families.llama.model import Attention, apply_rope, rope_tables

TINY = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=32)


def materialise(args: LlamaArgs, seed: int | None = 0) -> Llama:
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def test_forward_shape_and_dtype():
    model = materialise(TINY)
    tokens_BT = torch.randint(0, TINY.vocab_size, (3, 10))
    logits_BTV = model(tokens_BT)
    assert logits_BTV.shape == (3, 10, TINY.vocab_size)
    assert logits_BTV.dtype == torch.float32
    assert torch.isfinite(logits_BTV).all()


def test_too_long_sequence_is_an_error():
    model = materialise(TINY)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_causal_future_tokens_do_not_change_earlier_logits():
    model = materialise(TINY)
    tokens_BT = torch.randint(0, TINY.vocab_size, (2, 16))
    changed_BT = tokens_BT.clone()
    changed_BT[:, 9:] = (changed_BT[:, 9:] + 1) % TINY.vocab_size
    before, after = model(tokens_BT), model(changed_BT)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def test_rope_matches_complex_rotation():
    # Meta's reference rotates adjacent pairs as complex numbers by exp(i * pos * freq).
    head_dim, T = 16, 12
    cos_TR, sin_TR = rope_tables(head_dim, T, theta=500.0)
    x_BTHE = torch.randn(2, T, 3, head_dim)
    freqs_TR = torch.polar(torch.ones_like(cos_TR), torch.atan2(sin_TR, cos_TR))
    expected = torch.view_as_real(torch.view_as_complex(x_BTHE.unflatten(-1, (-1, 2))) * freqs_TR[:, None, :])
    torch.testing.assert_close(apply_rope(x_BTHE, cos_TR, sin_TR), expected.flatten(-2), rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_matches_explicit_per_head_attention():
    torch.manual_seed(0)
    args = LlamaArgs(dim=48, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
    attn = Attention(args)
    B, T, E, group = 2, 7, args.head_dim, args.n_heads // args.kv_heads
    cos_TR, sin_TR = rope_tables(E, T, args.rope_theta)
    x_BTD = torch.randn(B, T, args.dim)

    q_BTHE = apply_rope((x_BTD @ attn.wq.weight.T).view(B, T, args.n_heads, E), cos_TR, sin_TR)
    k_BTGE = apply_rope((x_BTD @ attn.wk.weight.T).view(B, T, args.kv_heads, E), cos_TR, sin_TR)
    v_BTGE = (x_BTD @ attn.wv.weight.T).view(B, T, args.kv_heads, E)
    causal_TT = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for h in range(args.n_heads):
        g = h // group  # query head h reads key/value head h // group
        scores_BTT = q_BTHE[:, :, h] @ k_BTGE[:, :, g].transpose(1, 2) / math.sqrt(E)
        probs_BTT = scores_BTT.masked_fill(~causal_TT, float("-inf")).softmax(-1)
        heads.append(probs_BTT @ v_BTGE[:, :, g])
    expected_BTD = torch.cat(heads, dim=-1) @ attn.wo.weight.T

    torch.testing.assert_close(attn(x_BTD, cos_TR, sin_TR), expected_BTD, rtol=1e-5, atol=1e-5)


def test_enable_gqa_agrees_with_expanded_heads():
    # The model expands kv heads itself; this pins that SDPA's own grouping means the same thing.
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expanded = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True
    )
    torch.testing.assert_close(grouped, expanded, rtol=1e-5, atol=1e-5)


def test_meta_build_allocates_nothing_and_rope_buffers_are_not_state():
    with torch.device("meta"):
        model = Llama(TINY)
    assert all(p.is_meta for p in model.parameters())
    assert "rope_cos" not in model.state_dict() and "rope_sin" not in model.state_dict()
    model.to_empty(device="cpu")
    model.init_weights()
    cos_TR, sin_TR = rope_tables(TINY.head_dim, TINY.max_seq_len, TINY.rope_theta)
    assert model.rope_cos.shape == (TINY.max_seq_len, TINY.head_dim // 2)
    torch.testing.assert_close(model.rope_cos, cos_TR, rtol=0, atol=0)
    torch.testing.assert_close(model.rope_sin, sin_TR, rtol=0, atol=0)


def test_init_is_deterministic_with_seed():
    a, b, c = materialise(TINY, seed=3), materialise(TINY, seed=3), materialise(TINY, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_init_values():
    args = LlamaArgs(dim=256, n_layers=8, n_heads=4, ffn_dim=512, vocab_size=512, init_std=0.05)
    model = materialise(args)
    residual_std = 0.05 / math.sqrt(2 * 8)
    block = model.layers[0]
    assert torch.equal(block.attention_norm.weight, torch.ones(256))
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.05, rel=0.03)
    assert block.attention.wq.weight.std().item() == pytest.approx(0.05, rel=0.03)
    assert block.attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.03)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.03)
    assert model.output.weight.std().item() == pytest.approx(residual_std, rel=0.03)


def test_no_biases_and_tied_embeddings():
    untied = Llama(TINY)
    assert not any(name.endswith("bias") for name, _ in untied.named_parameters())
    assert untied.output.weight is not untied.tok_embeddings.weight

    tied_args = LlamaArgs(**{**TINY.__dict__, "tie_embeddings": True})
    tied = materialise(tied_args)
    assert tied.output.weight is tied.tok_embeddings.weight
    # Tied weights keep the embedding's init, not the output layer's smaller one.
    assert tied.tok_embeddings.weight.std().item() == pytest.approx(tied_args.init_std, rel=0.2)


class CheckpointedBlock(nn.Module):
    """What the training loop does: wrap a block in place and keep it as a submodule."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)


def test_wrapped_blocks_are_initialised_and_give_the_same_gradients():
    reference = materialise(TINY, seed=1)
    with torch.device("meta"):
        wrapped = Llama(TINY)
    for i, block in enumerate(wrapped.layers):
        assert isinstance(block, TransformerBlock)
        wrapped.layers[i] = CheckpointedBlock(block)
    wrapped.to_empty(device="cpu")
    with torch.no_grad():
        for p in wrapped.parameters():
            p.fill_(float("nan"))
    wrapped.init_weights(seed=1)

    tokens_BT = torch.randint(0, TINY.vocab_size, (2, 12))
    for model in (reference, wrapped):
        model(tokens_BT).logsumexp(-1).mean().backward()
    ref_grads = [p.grad for p in reference.parameters()]
    for (name, p), g in zip(wrapped.named_parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"dim": 30}, "model.dim"),
        ({"n_kv_heads": 3}, "model.n_kv_heads"),
        ({"dim": 12, "n_heads": 4}, "even"),
    ],
)
def test_inconsistent_shapes_name_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        LlamaArgs(**{**TINY.__dict__, **change})

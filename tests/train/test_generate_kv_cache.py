"""accelrun generate decodes through a KV cache (issue 30, item 7): each new token is one position's work,
and the tokens are those a whole-context recompute gives (Llama with grouped-query attention, Gemma, and
a context that slides past model.max_seq_len)."""

from __future__ import annotations

import pytest
import torch

from accelrun.config.schema import ModelConfig
from accelrun.models import build_model
from accelrun.train.generate import generate

SHAPE = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 300}


def _model(arch: str = "llama", **more) -> torch.nn.Module:
    cfg = ModelConfig.model_validate({"arch": arch, **SHAPE, **more})
    return build_model(cfg, "cpu", seed=0).float().eval()


@torch.no_grad()
def _recomputed(model, ids: list[int], n: int, max_seq_len: int) -> list[int]:
    """Greedy tokens with the whole context run for every token; past ``max_seq_len`` the context keeps
    its last half and grows again."""
    ids, start = list(ids), max(0, len(ids) - max_seq_len)
    for _ in range(n):
        if len(ids) - start > max_seq_len:
            start = len(ids) - max_seq_len // 2
        ids.append(int(model(torch.tensor([ids[start:]]))[0, -1].argmax()))
    return ids


def _embedded_lengths(model) -> list[int]:
    seen: list[int] = []
    embed = model.tok_embeddings if hasattr(model, "tok_embeddings") else model.embed_tokens
    embed.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[1]))
    return seen


def test_each_new_token_is_one_position():
    model = _model()
    seen = _embedded_lengths(model)
    generate(model, [1, 2, 3, 4, 5], max_new_tokens=20, temperature=0.0, max_seq_len=2048)
    assert seen == [5] + [1] * 19  # the prompt once, then one position a token


@pytest.mark.parametrize("arch, more", [("llama", {}), ("gemma", {"head_dim": 32})])
def test_cached_tokens_are_the_recomputed_ones(arch, more):
    model = _model(arch, **more)
    prompt = [7, 3, 250, 9]
    assert generate(model, prompt, max_new_tokens=24, temperature=0.0, max_seq_len=2048) == \
        _recomputed(model, prompt, 24, 2048)
    # The model is itself again after: its own attention forwards and whole rotary tables.
    assert model(torch.tensor([prompt])).shape == (1, 4, 300)


def test_a_context_that_slides_past_max_seq_len_matches_the_recompute():
    model = _model(max_seq_len=16)
    prompt = [5, 6, 7]
    assert generate(model, prompt, max_new_tokens=30, temperature=0.0, max_seq_len=16) == \
        _recomputed(model, prompt, 30, 16)


def test_past_max_seq_len_a_token_is_one_position_between_slides():
    """Past the window the cache was dropped and the whole window recomputed for every token (2,048
    positions a token, 0.23 s); now the kept half is recomputed once per half window."""
    model = _model(max_seq_len=16)
    seen = _embedded_lengths(model)
    out = generate(model, [5, 6, 7], max_new_tokens=40, temperature=0.0, max_seq_len=16)
    assert len(out) == 43
    assert seen == [3] + [1] * 13 + ([8] + [1] * 8) * 2 + [8] + [1] * 7  # a slide at 17, 26 and 35 tokens
    assert sum(seen) < 2 * 40  # not 16 a token


def test_a_prompt_longer_than_the_window_keeps_its_last_window():
    model = _model(max_seq_len=16)
    seen = _embedded_lengths(model)
    prompt = list(range(1, 21))
    assert generate(model, prompt, max_new_tokens=3, temperature=0.0, max_seq_len=16) == \
        _recomputed(model, prompt, 3, 16)
    assert seen[0] == 16


def test_sampling_is_deterministic_for_a_seed():
    model = _model()
    a = generate(model, [1, 2], max_new_tokens=16, temperature=1.0, top_k=20, seed=3, max_seq_len=2048)
    assert a == generate(model, [1, 2], max_new_tokens=16, temperature=1.0, top_k=20, seed=3, max_seq_len=2048)


def test_a_model_without_a_cache_reads_the_whole_last_window_for_every_token():
    """The half-window slide spares a cache its recomputes; a model without one recomputes its context
    for every token anyway, so it keeps the last max_seq_len tokens (a review's finding)."""
    torch.manual_seed(0)

    class Plain(torch.nn.Module):  # no accelrun attention: no KV cache
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(300, 16), torch.nn.Linear(16, 300)

        def forward(self, tokens):
            return self.head(self.embed(tokens).cumsum(1))

    model = Plain().eval()
    seen = _embedded_lengths_of(model.embed)
    out = generate(model, [5, 6, 7], max_new_tokens=30, temperature=0.0, max_seq_len=16)
    assert seen == [min(n, 16) for n in range(3, 33)]  # the prompt, then a token at a time
    assert out == _exact_window(model, [5, 6, 7], 30, 16)


def _embedded_lengths_of(embed) -> list[int]:
    seen: list[int] = []
    embed.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[1]))
    return seen


@torch.no_grad()
def _exact_window(model, ids: list[int], n: int, window: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids[-window:]]))[0, -1].argmax()))
    return ids

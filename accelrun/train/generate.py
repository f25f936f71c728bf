"""``accelrun generate``: sample text from a run's newest complete checkpoint with the tokenizer it
trained with (its ``data.tokenizer``: byte-level, or a tokenizer.json)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from accelrun.train.checkpoint_model import (
    CheckpointModelError,
    find_checkpoint,
    load_checkpoint_model,
    run_tokenizer,
    run_values,
)
from accelrun.train.kv_cache import KVCache, kv_cache_unsupported


def load_run_model(ref: str | Path) -> torch.nn.Module:
    """The model of run (or checkpoint) ``ref``'s newest complete checkpoint, in this one process (CPU,
    fp32), whatever parallel layout wrote it."""
    model, _, _ = load_checkpoint_model(
        ref, "to sample from (train with checkpoint.enabled = true; checkpoint.save_final saves the last step)")
    return model.eval()


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, max_seq_len: int | None = None,
             stop_id: int | None = None) -> list[int]:
    """Append ``max_new_tokens`` sampled ids to ``prompt_ids`` (greedy when temperature is 0), or fewer
    when ``stop_id`` (the end of a text) is sampled: it is the last id then. Deterministic for a seed (a
    private generator).

    The model reads at most ``max_seq_len`` tokens. Built-in families decode through a KV cache
    (``accelrun.train.kv_cache``): each new token costs one position's work, and when the text outgrows
    the window its context starts over from the last ``max_seq_len // 2`` (:func:`context_start`), one
    pass over the kept half. Other models recompute their context, the last ``max_seq_len`` tokens, for
    every token."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    if max_new_tokens == 0:
        return ids
    with contextlib.ExitStack() as stack:
        stack.enter_context(_decode_threads(model))
        cache = stack.enter_context(KVCache.attach(model)) if kv_cache_unsupported(model) is None else None
        start = max(0, len(ids) - max_seq_len) if max_seq_len else 0  # a long prompt: its last window
        logits_V = _context_logits(model, cache, ids[start:])
        for i in range(max_new_tokens):
            ids.append(_sample(logits_V, temperature, top_k, gen))
            if i + 1 == max_new_tokens or ids[-1] == stop_id:
                break
            if cache is None:  # every token recomputes its context anyway: the whole last window
                start = max(0, len(ids) - max_seq_len) if max_seq_len else 0
                logits_V = _context_logits(model, None, ids[start:])
                continue
            slid = context_start(len(ids), start, max_seq_len)
            if slid == start:
                logits_V = cache(torch.tensor([ids[-1:]], dtype=torch.long))[0, -1].float()
            else:  # the context slid: its positions all moved
                start = slid
                logits_V = _context_logits(model, cache, ids[start:])
    return ids


def context_start(length: int, start: int, max_seq_len: int | None) -> int:
    """Where the context of a text ``length`` tokens long begins, given that it began at ``start``: the
    same place while it fits ``max_seq_len``, else the last ``max_seq_len // 2`` tokens (at least one).

    Half, not a window sliding a token at a time: with rotary positions counted from the context's start,
    every slide moves each kept token's position, so the cache is recomputed; sliding by half does that
    once per ``max_seq_len // 2`` tokens instead of for every token (0.23 s a token at 2,048 before)."""
    if max_seq_len is None or length - start <= max_seq_len:
        return start
    return length - max(1, max_seq_len // 2)


# Below this many parameters a token's matmuls (about 2 FLOPs a parameter) take well under a millisecond
# on one core, and more threads cost more in synchronisation than they share: the default 1.8 M-parameter
# model sampled 100 tokens in 0.36 s on one thread and 1.6 s on this machine's two beside a busy process.
ONE_THREAD_BELOW_PARAMS = 20_000_000


@contextlib.contextmanager
def _decode_threads(model: torch.nn.Module):
    """One torch thread while decoding a small model; torch's own count otherwise."""
    before = torch.get_num_threads()
    small = sum(p.numel() for p in model.parameters()) < ONE_THREAD_BELOW_PARAMS
    if small:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _context_logits(model: torch.nn.Module, cache: KVCache | None, context: list[int]) -> torch.Tensor:
    """The next token's logits from the whole context; a cache starts over from it."""
    ctx_1T = torch.tensor([context], dtype=torch.long)
    if cache is None:
        return model(ctx_1T)[0, -1].float()
    cache.reset()
    return cache(ctx_1T)[0, -1].float()


def _sample(logits_V: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits_V.argmax())
    logits_V = logits_V / temperature
    if top_k is not None and top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    probs_V = torch.softmax(logits_V, dim=-1)
    return int(torch.multinomial(probs_V, 1, generator=gen))


@dataclass(frozen=True)
class Generated:
    text: str  # the prompt and its continuation
    run: Path
    checkpoint: Path
    step: int | None
    kv_cache: str | None  # None: decoded with a KV cache; else why not
    beyond_training: str | None = None  # a warning: the text runs past the windows the model trained on
    new_tokens: int = 0  # sampled (fewer than asked when the text ended)
    ended: bool = False  # it sampled the tokenizer's end of text, and stopped there


def _tokenizer_trained_with(ckpt: Path) -> str | None:
    """The tokenizer name a checkpoint's run encoded its data with (None: an older checkpoint, or data
    that was not text)."""
    import json

    from accelrun.train.checkpoint import TRAIN_STATE

    try:
        return json.loads((ckpt / TRAIN_STATE).read_text()).get("tokenizer")
    except (OSError, ValueError):
        return None


def generate_text(ref: str | Path, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0, stop_at_end: bool = True) -> Generated:
    """The prompt followed by the sampled continuation, in the run's own tokens (byte-level with a BOS
    first, or a tokenizer.json's own encoding of the prompt, its special tokens included), and which run,
    checkpoint and step it came from."""
    from accelrun.data.tokenizer import ByteTokenizer, get_tokenizer
    from accelrun.train.checkpoint import read_info

    newest, run = find_checkpoint(ref, "to sample from")
    name = run_tokenizer(run)
    tok = get_tokenizer(name)  # a tokenizer file that is gone: exit 2 naming it
    trained_with = _tokenizer_trained_with(newest)  # before the weights are read: they may take minutes
    if trained_with is not None and trained_with != tok.name:
        raise CheckpointModelError(
            f"{ref}: data.tokenizer {name!r} is not the tokenizer the run trained with (its checkpoint says "
            f"{trained_with}, the file is now {tok.name}): the model's ids would be decoded as other text; put "
            "back the file it trained with")
    model, _, ckpt = load_checkpoint_model(
        ref, "to sample from (train with checkpoint.enabled = true; checkpoint.save_final saves the last step)")
    model.eval()
    vocab = model.args.vocab_size if hasattr(model, "args") else None
    if vocab is not None and vocab < tok.vocab_size:
        raise CheckpointModelError(f"{ref}: the model's vocabulary ({vocab}) is smaller than the tokenizer "
                                   f"{name!r}'s ({tok.vocab_size}); it was not trained on its tokens")
    ids = tok.encode(prompt, bos=True) if isinstance(tok, ByteTokenizer) else tok.encode(prompt)
    window = getattr(getattr(model, "args", None), "max_seq_len", None)
    # The end of a text (the id that separated documents in training) ends the sample: past it the model
    # starts another document, glued on (a new user read "word.Of" where one text ended).
    stop_id = getattr(tok, "EOS", None) if stop_at_end else None
    out = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                   max_seq_len=window, stop_id=stop_id)
    ended = stop_id is not None and len(out) > len(ids) and out[-1] == stop_id
    info = read_info(ckpt)
    values = run_values(run)
    trained = (values.get("train") or {}).get("seq_len")
    # The positions the model read: the last sampled token is never fed, and the context slides at max_seq_len.
    read = min(len(out) - 1, window) if window else len(out) - 1
    pretrained = (values.get("model") or {}).get("hf") is not None  # its checkpoint's own training saw longer
    beyond = (f"the prompt and {max_new_tokens} new tokens put {read} tokens before the model, more than the "
              f"{trained} of the windows it trained on: past them its positions are untrained, and its text may "
              f"turn to noise" if isinstance(trained, int) and read > trained and not pretrained else None)  # fmt: skip
    return Generated(tok.decode(out), run, ckpt, info.step if info else None, kv_cache_unsupported(model), beyond,
                     len(out) - len(ids), ended)

"""``accelrun generate``: sample text from a run's newest complete checkpoint with the tokenizer it
trained with (its ``data.tokenizer``: byte-level, or a tokenizer.json)."""

from __future__ import annotations

from pathlib import Path

import torch

from accelrun.train.checkpoint_model import (
    CheckpointModelError,
    find_checkpoint,
    load_checkpoint_model,
    run_tokenizer,
)


def load_run_model(ref: str | Path) -> torch.nn.Module:
    """The model of run (or checkpoint) ``ref``'s newest complete checkpoint, in this one process (CPU,
    fp32), whatever parallel layout wrote it."""
    model, _, _ = load_checkpoint_model(
        ref, "to sample from (train with checkpoint.enabled = true; checkpoint.save_final saves the last step)")
    return model.eval()


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, max_seq_len: int | None = None) -> list[int]:
    """Append ``max_new_tokens`` sampled ids to ``prompt_ids`` (greedy when temperature is 0). The
    context is cut to the last ``max_seq_len`` tokens. Deterministic for a seed (a private generator)."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        ctx_1T = torch.tensor([ids[-max_seq_len:] if max_seq_len else ids], dtype=torch.long)
        logits_V = model(ctx_1T)[0, -1].float()
        if temperature <= 0:
            ids.append(int(logits_V.argmax()))
            continue
        logits_V = logits_V / temperature
        if top_k is not None and top_k < logits_V.numel():
            kth = torch.topk(logits_V, top_k).values[-1]
            logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
        probs_V = torch.softmax(logits_V, dim=-1)
        ids.append(int(torch.multinomial(probs_V, 1, generator=gen)))
    return ids


def generate_text(ref: str | Path, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8,
                  top_k: int | None = 50, seed: int = 0) -> str:
    """The prompt followed by the sampled continuation, in the run's own tokens: byte-level with a BOS
    first, or a tokenizer.json's own encoding of the prompt (its special tokens included)."""
    from accelrun.data.tokenizer import ByteTokenizer, get_tokenizer

    _, run = find_checkpoint(ref, "to sample from")
    name = run_tokenizer(run)
    tok = get_tokenizer(name)  # a tokenizer file that is gone: exit 2 naming it
    model = load_run_model(ref)
    vocab = model.args.vocab_size if hasattr(model, "args") else None
    if vocab is not None and vocab < tok.vocab_size:
        raise CheckpointModelError(f"{ref}: the model's vocabulary ({vocab}) is smaller than the tokenizer "
                                   f"{name!r}'s ({tok.vocab_size}); it was not trained on its tokens")
    ids = tok.encode(prompt, bos=True) if isinstance(tok, ByteTokenizer) else tok.encode(prompt)
    out = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                   max_seq_len=getattr(getattr(model, "args", None), "max_seq_len", None))
    return tok.decode(out)

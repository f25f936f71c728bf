"""``accelrun generate``: sample text from a run's newest complete checkpoint with the byte tokenizer."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from accelrun.errors import UserError


class GenerateError(UserError):
    pass


def load_run_model(ref: str | Path) -> torch.nn.Module:
    """The model of run (or checkpoint) ``ref``'s newest complete checkpoint, in this one process (CPU,
    fp32), whatever parallel layout wrote it (torch.distributed.checkpoint reshards on load)."""
    import torch.distributed.checkpoint as dcp

    from accelrun.models import build_model
    from accelrun.report.rundata import RunNotFound, resolve_run_path
    from accelrun.train.checkpoint import TRAIN_STATE, complete_checkpoints
    from accelrun.train.export import _model_config

    path = Path(ref).expanduser()
    if (path / TRAIN_STATE).is_file():
        ckpt, run = path, path.parent.parent
    else:
        try:
            run = resolve_run_path(path)
        except RunNotFound as e:
            raise GenerateError(str(e)) from None
        done = complete_checkpoints(run / "checkpoints")
        if not done:
            raise GenerateError(f"{run}: no complete checkpoint under {run / 'checkpoints'} to sample from "
                                "(train with checkpoint.enabled = true; checkpoint.save_final saves the last step)")
        ckpt = done[-1].path
    cfg = _model_config(run)
    model = build_model(cfg, "cpu", seed=0)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # one process reading a DCP checkpoint is the intent here
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, checkpoint_id=ckpt, no_dist=True)  # this process alone, group or not
    except Exception as e:
        raise GenerateError(f"{ckpt}: cannot read the model's weights ({str(e).strip().splitlines()[0]})") from None
    model.load_state_dict(state["model"])
    return model.float().eval()


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
    """The prompt followed by the sampled continuation, decoded with the byte tokenizer."""
    from accelrun.data.tokenizer import get_tokenizer

    tok = get_tokenizer("byte")
    model = load_run_model(ref)
    vocab = model.args.vocab_size if hasattr(model, "args") else None
    if vocab is not None and vocab < tok.vocab_size:
        raise GenerateError(f"{ref}: the model's vocabulary ({vocab}) is smaller than the byte tokenizer's "
                            f"({tok.vocab_size}); it was not trained on byte-level text")
    ids = tok.encode(prompt, bos=True)
    out = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                   max_seq_len=getattr(getattr(model, "args", None), "max_seq_len", None))
    return tok.decode(out)

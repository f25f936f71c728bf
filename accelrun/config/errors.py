"""Recipe errors, and the "did you mean" used in their messages."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from accelrun.errors import UserError


class ConfigError(UserError):
    """A recipe problem the user can fix: file:line, key, what was expected."""


# Names other tools (transformers' TrainingArguments, torch.optim, torchtitan) give the keys here, which
# no spelling distance finds: offered only where the name is a key at that place.
SYNONYMS = {"learning_rate": "lr", "wd": "weight_decay", "batch_size": "micro_batch", "max_steps": "steps",
            "num_layers": "n_layers", "hidden_size": "dim", "num_heads": "n_heads",
            "warmup": "warmup_steps", "gradient_accumulation_steps": "grad_accum", "max_grad_norm": "grad_clip"}


def nearest(word: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a misspelt ``word`` (``trian`` -> ``train``), or None."""
    options = list(candidates)
    if (known := SYNONYMS.get(word.lower())) and known in options:  # another tool's name for it
        return known
    matches = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if matches:
        return matches[0]
    # A truncated value (`bf16` for `bf16-mixed`) is too short for a similarity ratio to catch.
    prefixed = [c for c in options if len(word) >= 2 and c.lower().startswith(word.lower())]
    return prefixed[0] if len(prefixed) == 1 else None

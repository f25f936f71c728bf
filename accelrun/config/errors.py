"""Errors a user can cause with a recipe: one clear message each, exit code 2 at the CLI."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(Exception):
    """A recipe problem the user can fix. ``messages`` holds one line per problem found."""

    def __init__(self, messages: str | list[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


def nearest(word: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a misspelt ``word`` (``trian`` -> ``train``), or None."""
    options = list(candidates)
    matches = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if matches:
        return matches[0]
    # A truncated value (`bf16` for `bf16-mixed`) is too short for a similarity ratio to catch.
    prefixed = [c for c in options if len(word) >= 2 and c.lower().startswith(word.lower())]
    return prefixed[0] if len(prefixed) == 1 else None

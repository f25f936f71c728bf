"""Which bytes of which files a text source reads: shared by the byte reader (``text``), the
tokenizer.json encoder (``hf_documents``) and ``prepare_tokens``, so each stops at the same place."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from accelrun.config.record_paths import empty_corpus
from accelrun.data.errors import DataError


def plan_reads(files: Sequence[Path], max_bytes: int | None) -> list[tuple[Path, int]]:
    """(file, bytes to read) for each file read, stopping once ``max_bytes`` is reached. Empty files
    are left out: they would only add a lone EOS. Files that are all empty are a ``DataError``."""
    plan: list[tuple[Path, int]] = []
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            size = f.stat().st_size
        except OSError as e:
            raise DataError(f"cannot read {str(f)!r}: {e.strerror}") from None
        if max_bytes is not None:
            size = min(size, max_bytes - total)
        if size > 0:
            plan.append((f, size))
            total += size
    if files and not plan:  # (a stream of no tokens has nothing to train on, and no dtype to store)
        raise DataError(empty_corpus(files))
    return plan

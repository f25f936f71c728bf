"""Text files as a byte-token stream: glob expansion and the shared document reader.

Each file is one document; documents are concatenated with ``EOS`` after each. Reading stops at
``max_bytes`` of text (the last document is cut short to fit). The byte tokenizer gives one token
per byte, so the whole stream is preallocated as uint16 (2 bytes a token) and each file is read
into one buffer: no per-byte Python work and no intermediate lists.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from accelrun.config.data_paths import expand_paths
from accelrun.data.encoded_cache import cache_key, cached_stream
from accelrun.data.errors import DataError
from accelrun.data.hf_documents import encode_documents_stream
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.read_plan import plan_reads
from accelrun.data.stream import TensorStream, short_hash
from accelrun.data.tokenizer import ByteTokenizer


def read_documents(
    files: Sequence[Path], *, max_bytes: int | None, fingerprint: dict, vocab_size: int = 258
) -> TensorStream:
    """Read ``files`` into one uint16 byte-token stream, ``EOS`` after each document.

    ``fingerprint`` is completed with ``files``, ``bytes``, ``tokens`` and ``sha256`` (a hash of
    the content and the document boundaries, so the same text gives the same hash on any machine).
    """
    return _read_planned(plan_reads(files, max_bytes), fingerprint, vocab_size)


def _read_planned(plan: Sequence[tuple[Path, int]], fingerprint: dict, vocab_size: int = 258) -> TensorStream:
    # Every file goes into one buffer with a one-byte gap after it for the EOS, and the buffer
    # becomes tokens in a single conversion: many mid-sized tensor copies (one per file) cost ~40x
    # more than one big one, because each wakes torch's intra-op thread pool.
    raw = bytearray(sum(n for _, n in plan) + len(plan))
    view = memoryview(raw)
    hasher = hashlib.sha256()
    eos_at: list[int] = []
    pos = 0
    for path, n in plan:
        try:
            with open(path, "rb") as fh:
                got = fh.readinto(view[pos : pos + n])  # short if the file shrank since it was listed
        except OSError as e:
            raise DataError(f"cannot read {str(path)!r}: {e.strerror}") from None
        hasher.update(got.to_bytes(8, "little"))
        hasher.update(view[pos : pos + got])
        pos += got
        eos_at.append(pos)
        pos += 1
    view.release()
    tokens = torch.empty(pos, dtype=torch.uint16)
    if pos:
        tokens.copy_(torch.frombuffer(raw, dtype=torch.uint8, count=pos))  # byte tokenizer: id == byte
        # uint16 lacks index_fill; the int16 view has the same bits for ids < 32768.
        tokens.view(torch.int16).index_fill_(0, torch.tensor(eos_at), ByteTokenizer.EOS)
    del raw
    fingerprint = dict(
        fingerprint, files=len(plan), bytes=pos - len(plan), tokens=pos, sha256=short_hash(hasher)
    )
    # Each document starts after the previous one's EOS.
    starts = torch.tensor([0] + [e + 1 for e in eos_at[:-1]], dtype=torch.int64) if eos_at else None
    return TensorStream([tokens], vocab_size=vocab_size, fingerprint=fingerprint, document_starts=starts)


def load_text(paths: Sequence[str], *, max_bytes: int | None, tokenizer: ByteTokenizer | HFTokenizer | None = None,
              ) -> TensorStream:
    """The ``text`` source: files or globs from ``data.paths``, one document each, read as bytes (the
    default) or encoded with a tokenizer.json ``tokenizer``."""
    files = expand_paths(paths)
    return read_documents_with(tokenizer, files, max_bytes=max_bytes, fingerprint={"source": "text"})


def read_documents_with(tokenizer: ByteTokenizer | HFTokenizer | None, files: Sequence[Path], *,
                        max_bytes: int | None, fingerprint: dict) -> TensorStream:
    """``files`` as one stream of ``tokenizer``'s tokens (None: the byte tokenizer)."""
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        fingerprint = {**fingerprint, "tokenizer": "byte"}
        plan = plan_reads(files, max_bytes)
        # Through the cache of encoded text for its memory map, not for time: read at memory speed.
        return cached_stream(cache_key("byte", plan, max_bytes, fingerprint),
                             lambda: _read_planned(plan, fingerprint))
    return encode_documents_stream(files, tokenizer, max_bytes=max_bytes, fingerprint=fingerprint)

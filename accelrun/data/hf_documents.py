"""Text files to tokens with a tokenizer.json tokenizer: the ``text`` and ``builtin`` sources and
``accelrun data prepare`` share this.

Unlike the byte tokenizer, the number of tokens is not known before encoding, so documents are read
and encoded in batches of about ``batch_bytes`` of text, each batch becoming one flat tensor. A
document is encoded whole (cutting it would change its tokens at the cut).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from accelrun.data.encoded_cache import cache_key, cached_stream
from accelrun.data.errors import DataError
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.read_plan import plan_reads
from accelrun.data.stream import TensorStream, short_hash

BATCH_BYTES = 4 << 20


def _read_text(path: Path, n: int) -> tuple[str, int]:
    try:
        with open(path, "rb") as fh:
            data = fh.read(n)  # short if the file shrank since it was listed
    except OSError as e:
        raise DataError(f"cannot read {str(path)!r}: {e.strerror}") from None
    return data.decode("utf-8", errors="replace"), len(data)


def encode_files(
    plan: Sequence[tuple[Path, int]], tokenizer: HFTokenizer, *, batch_bytes: int = BATCH_BYTES,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[tuple[torch.Tensor, list[int]]]:
    """(tokens of a batch of documents as one 1-D tensor of ``tokenizer.token_dtype``, each document's
    token count), for the (file, bytes to read) pairs of ``plan`` in order. ``on_bytes(n)`` is called
    with the bytes of text read so far."""
    texts: list[str] = []
    pending = done = 0

    def encoded() -> tuple[torch.Tensor, list[int]]:
        docs = tokenizer.encode_documents(texts)
        flat = torch.tensor(list(itertools.chain.from_iterable(docs)), dtype=torch.int64)
        return flat.to(tokenizer.token_dtype), [len(d) for d in docs]

    for path, n in plan:
        text, got = _read_text(path, n)
        texts.append(text)
        pending += got
        done += got
        if on_bytes is not None:
            on_bytes(done)
        if pending >= batch_bytes:
            yield encoded()
            texts, pending = [], 0
    if texts:
        yield encoded()


def encode_documents_stream(
    files: Sequence[Path], tokenizer: HFTokenizer, *, max_bytes: int | None, fingerprint: dict, cache: bool = True,
) -> TensorStream:
    """The files as one token stream (what ``text.read_documents`` does for the byte tokenizer), from the
    cache of encoded text when this text was encoded before (``accelrun.data.encoded_cache``).

    ``fingerprint`` is completed with the tokenizer's name, ``files``, ``bytes``, ``tokens`` and a
    ``sha256`` of the tokens and the document lengths."""
    plan = plan_reads(files, max_bytes)

    def encode() -> TensorStream:
        hasher = hashlib.sha256(tokenizer.name.encode())
        segments: list[torch.Tensor] = []
        doc_lengths: list[int] = []
        read = [0]
        for tokens, lengths in encode_files(plan, tokenizer, on_bytes=lambda n: read.__setitem__(0, n)):
            doc_lengths.extend(n for n in lengths if n > 0)
            hasher.update(torch.tensor(lengths, dtype=torch.int64).numpy().tobytes())
            hasher.update(tokens.view(torch.uint8).numpy().tobytes() if tokens.numel() else b"")
            segments.append(tokens)
        n_tokens = sum(s.numel() for s in segments)
        done = dict(fingerprint, tokenizer=tokenizer.name, files=len(plan), bytes=read[0], tokens=n_tokens,
                    sha256=short_hash(hasher))
        lengths = torch.tensor(doc_lengths, dtype=torch.int64)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]) if doc_lengths else None
        return TensorStream(segments, vocab_size=tokenizer.vocab_size, fingerprint=done, document_starts=starts)

    if not cache:
        return encode()
    return cached_stream(cache_key(tokenizer.name, plan, max_bytes, fingerprint), encode)

"""``prepare_tokens``: text files (paths or globs) tokenized into one token file (``tokfile``'s format).

The byte tokenizer's documents go through a fixed buffer, converted a chunk at a time; a
tokenizer.json's are encoded a batch of documents at a time (``hf_documents.encode_files``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from accelrun.config.data_paths import expand_paths
from accelrun.data.atomic_file import hold, release, remove_dead_scratch, scratch_path
from accelrun.data.doc_index import index_path, write_doc_index
from accelrun.data.errors import DataError
from accelrun.data.hf_documents import encode_files
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.read_plan import plan_reads
from accelrun.data.tokenizer import get_tokenizer
from accelrun.data.tokfile import HEADER_SIZE, TokenFileHeader, check_little_endian

_WRITE_CHUNK = 8 << 20  # text bytes converted and written at a time

ProgressFn = Callable[[int, int], None]


class _ChunkWriter:
    """Collects documents as bytes with a one-byte gap after each, and turns a full buffer into
    tokens with one tensor copy (per-document copies are far slower; see ``text.read_documents``)."""

    def __init__(self, fh, hasher, eos: int, capacity: int = _WRITE_CHUNK):
        self.fh, self.hasher, self.eos = fh, hasher, eos
        self.raw = bytearray(capacity)
        self.view = memoryview(self.raw)
        self.raw_u8 = torch.frombuffer(self.raw, dtype=torch.uint8)
        self.out = bytearray(2 * capacity)
        self.out_u16 = torch.frombuffer(self.out, dtype=torch.uint16)
        self.fill = 0
        self.eos_at: list[int] = []
        self.n_tokens = 0

    def space(self) -> int:
        return len(self.raw) - self.fill

    def read_from(self, fh, n: int) -> int:
        got = fh.readinto(self.view[self.fill : self.fill + n])
        self.fill += got
        return got

    def end_document(self) -> None:
        if self.space() == 0:
            self.flush()
        self.eos_at.append(self.fill)
        self.fill += 1

    def flush(self) -> None:
        k = self.fill
        if k == 0:
            return
        tokens = self.out_u16[:k]
        tokens.copy_(self.raw_u8[:k])  # byte tokenizer: token id == byte value
        if self.eos_at:
            # uint16 lacks index_fill; the int16 view has the same bits for ids < 32768.
            tokens.view(torch.int16).index_fill_(0, torch.tensor(self.eos_at), self.eos)
        payload = memoryview(self.out)[: 2 * k]
        self.fh.write(payload)
        self.hasher.update(payload)
        self.n_tokens += k
        self.fill = 0
        self.eos_at = []


def prepare_tokens(
    inputs: Sequence[str],
    output: str | os.PathLike,
    tokenizer: str = "byte",
    max_bytes: int | None = None,
    progress: ProgressFn | None = None,
    tokenizer_key: str = "data.tokenizer",
) -> dict:
    """Tokenize text files (paths or globs) into one token file at ``output``.

    ``tokenizer`` is ``byte`` or a tokenizer.json (or a folder holding one; errors call it
    ``tokenizer_key``); the header records its name (``byte``, or ``hf-`` + a hash of the file). Each input file is a document followed by the
    tokenizer's end-of-text token; reading stops after ``max_bytes`` of text.
    ``progress(done_bytes, total_bytes)`` is called as text is read. Returns a summary:
    ``path, files, bytes, tokens, token_bytes, tokenizer, vocab_size, sha256`` (``tokenizer_file``
    for a tokenizer.json) and ``between_documents``.

    >>> prepare_tokens(["corpus/**/*.txt"], "data/corpus.tok")  # doctest: +SKIP
    {'path': 'data/corpus.tok', 'files': 12, 'bytes': 1048576, 'tokens': 1048588, ...}
    """
    check_little_endian()
    tok = get_tokenizer(tokenizer, key=tokenizer_key)
    out = Path(output)
    # An output (or its index) inside an input glob (``data/*`` -> ``data/x.tok``) must not be read as text.
    own = {os.path.abspath(out), os.path.abspath(index_path(out))}
    files = [f for f in expand_paths(inputs, key="inputs") if os.path.abspath(f) not in own]
    if not files:
        raise DataError(f"inputs: no text files besides the output {str(out)!r}")
    plan = plan_reads(files, max_bytes)
    total = sum(n for _, n in plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_scratch(out)  # what a killed prepare of this file left
    tmp = scratch_path(out)
    hasher = hashlib.sha256()
    done = [0]

    def on_bytes(n: int) -> None:
        done[0] = n
        if progress is not None:
            progress(n, total)

    held = None
    try:
        with open(tmp, "wb") as fh:
            held = hold(tmp)  # until renamed into place: a later prepare leaves it alone while this one lives
            fh.write(b"\0" * HEADER_SIZE)  # placeholder until the count and hash are known
            doc_lengths: list[int] = []
            if isinstance(tok, HFTokenizer):
                n_tokens, token_bytes = _write_encoded(fh, hasher, plan, tok, on_bytes, doc_lengths)
            else:
                n_tokens, token_bytes = _write_bytes(fh, hasher, plan, tok.EOS, on_bytes, doc_lengths)
            header = TokenFileHeader(token_bytes, tok.vocab_size, n_tokens, tok.name, hasher.hexdigest())
            fh.seek(0)
            fh.write(header.pack())
            fh.flush()
            os.fsync(fh.fileno())
        # The index first: a stop between the two leaves an index that names other tokens, which is
        # refused when read, never a new token file paired with a stale index.
        write_doc_index(out, _starts(doc_lengths), header.sha256)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        release(held)
    if progress is not None and done[0] != total:
        progress(done[0], done[0])
    return {
        "path": str(out),
        "files": len(plan),
        "bytes": done[0],
        "tokens": header.n_tokens,
        "token_bytes": header.token_bytes,
        "tokenizer": header.tokenizer,
        "vocab_size": header.vocab_size,
        "sha256": header.sha256[:16],
        **({"tokenizer_file": str(tok.info.path)} if isinstance(tok, HFTokenizer) else {}),
        "between_documents": _separator(tok),
    }


def _starts(doc_lengths: list[int]) -> torch.Tensor:
    lengths = torch.tensor([n for n in doc_lengths if n > 0], dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]) if lengths.numel() else lengths


def _separator(tok) -> str:
    if isinstance(tok, HFTokenizer):
        if tok.EOS is None:
            return "nothing (no eos_token in a tokenizer_config.json beside the tokenizer)"
        return f"{tok.info.eos_token} (id {tok.EOS})"
    return f"EOS (id {tok.EOS})"


def _write_bytes(fh, hasher, plan, eos: int, on_bytes: Callable[[int], None], doc_lengths: list[int],
                 ) -> tuple[int, int]:
    """The byte tokenizer: token id == byte value, read straight into the output buffer."""
    writer = _ChunkWriter(fh, hasher, eos)
    done = 0
    for path, n in plan:
        with open(path, "rb") as src:
            left = n
            doc_start = done
            while left:
                if writer.space() == 0:
                    writer.flush()
                got = writer.read_from(src, min(left, writer.space()))
                if got == 0:  # the file shrank since it was listed
                    break
                left -= got
                done += got
                on_bytes(done)
        writer.end_document()
        doc_lengths.append(done - doc_start + 1)  # its text and the EOS after it
    writer.flush()
    return writer.n_tokens, 2


def _write_encoded(fh, hasher, plan, tok: HFTokenizer, on_bytes: Callable[[int], None], doc_lengths: list[int],
                   ) -> tuple[int, int]:
    """A tokenizer.json tokenizer: documents encoded a batch at a time (``hf_documents.encode_files``)."""
    token_bytes = 2 if tok.token_dtype == torch.uint16 else 4  # int32 ids < 2**31 have uint32's bits
    n_tokens = 0
    for tokens, lengths in encode_files(plan, tok, on_bytes=on_bytes):
        doc_lengths.extend(lengths)
        payload = tokens.numpy().tobytes()
        fh.write(payload)
        hasher.update(payload)
        n_tokens += tokens.numel()
    return n_tokens, token_bytes

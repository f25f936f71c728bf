"""Pre-tokenized files (``.tok``): a fixed header, then the tokens as raw little-endian integers.

Layout (all integers little-endian; the header is 128 bytes so the payload stays aligned)::

    offset size  field
         0    8  magic        b"ACCTOK01" (format name + version)
         8    2  token_bytes  2 = uint16 tokens, 4 = uint32 tokens
        10    2  reserved     0
        12    4  vocab_size   every token id is < vocab_size
        16    8  n_tokens
        24   16  tokenizer    ASCII name, NUL-padded (e.g. "byte")
        40   32  sha256       digest of the payload bytes
        72   56  reserved     zeros
       128    -  payload      n_tokens × token_bytes

Files are memory-mapped and viewed as a tensor without copying (``mmap`` + ``torch.frombuffer``),
so a data set larger than RAM costs only the pages a run touches. ``prepare_tokens`` writes one
file atomically (a temporary file, then ``os.replace``): a crash never leaves a half-written file
under the real name.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from accelrun.data.errors import DataError
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.stream import TensorStream, short_hash
from accelrun.data.text import expand_paths, plan_reads
from accelrun.data.tokenizer import get_tokenizer

MAGIC = b"ACCTOK01"
HEADER_SIZE = 128
_HEADER = struct.Struct("<8sHHIQ16s32s")  # the fields above; zeros pad it to HEADER_SIZE
_DTYPES = {2: torch.uint16, 4: torch.uint32}
_WRITE_CHUNK = 8 << 20  # text bytes converted and written at a time

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class TokenFileHeader:
    token_bytes: int
    vocab_size: int
    n_tokens: int
    tokenizer: str
    sha256: str  # hex digest of the payload

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.token_bytes]

    def pack(self) -> bytes:
        name = self.tokenizer.encode("ascii")
        if len(name) > 16:
            raise ValueError(f"tokenizer name {self.tokenizer!r} is longer than 16 bytes")
        fields = _HEADER.pack(
            MAGIC, self.token_bytes, 0, self.vocab_size, self.n_tokens, name, bytes.fromhex(self.sha256)
        )
        return fields.ljust(HEADER_SIZE, b"\0")


def _check_little_endian() -> None:
    # Tokens are stored little-endian and viewed in place; a big-endian host would need a byte swap.
    if sys.byteorder != "little":
        raise DataError("token files need a little-endian machine (this one is big-endian)")


def read_header(path: str | os.PathLike, data: bytes | mmap.mmap | None = None) -> TokenFileHeader:
    """Parse and check the header of the token file at ``path`` (or of ``data``, its contents)."""
    if data is None:
        with open(path, "rb") as fh:
            head = fh.read(HEADER_SIZE)
            size = os.fstat(fh.fileno()).st_size
    else:
        head, size = bytes(data[:HEADER_SIZE]), len(data)
    if head[:6] != MAGIC[:6]:
        raise DataError(f"{path}: not an accelrun token file (starts with {head[:8]!r}, expected {MAGIC!r})")
    if len(head) < HEADER_SIZE:
        raise DataError(
            f"{path}: truncated token file: {size} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    if head[:8] != MAGIC:
        raise DataError(
            f"{path}: token file version {head[:8]!r} is not supported (this accelrun reads {MAGIC!r})"
        )
    _, token_bytes, _, vocab_size, n_tokens, name, digest = _HEADER.unpack_from(head)
    if token_bytes not in _DTYPES:
        raise DataError(f"{path}: unknown token size {token_bytes} bytes in the header (expected 2 or 4)")
    expected = HEADER_SIZE + n_tokens * token_bytes
    if size != expected:
        what = "truncated token file" if size < expected else "token file longer than its header says"
        raise DataError(
            f"{path}: {what}: the header declares {n_tokens} tokens ({expected} bytes in all), "
            f"the file has {size} bytes"
        )
    return TokenFileHeader(
        token_bytes, vocab_size, n_tokens, name.rstrip(b"\0").decode("ascii"), digest.hex()
    )


def open_tokens(path: str | os.PathLike, *, verify: bool = False) -> tuple[TokenFileHeader, torch.Tensor]:
    """The header and a zero-copy tensor view of the tokens of one file (read-only memory map).

    ``verify`` re-hashes the payload, compares it with the header and checks that every id is below
    the header's vocabulary (reads the whole file; remembered per file version in the cache folder)."""
    _check_little_endian()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise DataError(f"{path}: empty file, not an accelrun token file")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    header = read_header(path, mm)
    marker = _verified_marker(path, header) if verify else None
    if marker is not None and not marker.exists():
        digest = hashlib.sha256(memoryview(mm)[HEADER_SIZE:]).hexdigest()
        if digest != header.sha256:
            raise DataError(f"{path}: the tokens' sha256 is {digest[:12]}…, the header records "
                            f"{header.sha256[:12]}…: the file was changed or damaged after it was written; "
                            "prepare it again (accelrun data prepare)")
    if header.n_tokens == 0:
        return header, torch.empty(0, dtype=header.dtype)
    with warnings.catch_warnings():
        # The map is read-only and torch warns that writes through the tensor would be undefined;
        # nothing here writes to it. The tensor keeps the map alive.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tokens = torch.frombuffer(mm, dtype=header.dtype, count=header.n_tokens, offset=HEADER_SIZE)
    if marker is not None and not marker.exists():
        _check_ids(path, header, tokens)
        with contextlib.suppress(OSError):  # only a cache: unwritable costs the next run a re-check
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return header, tokens


def _check_ids(path, header: TokenFileHeader, tokens: torch.Tensor, chunk: int = 1 << 24) -> None:
    """Every id below the header's vocabulary: an id past it would index past the embedding table."""
    for start in range(0, tokens.numel(), chunk):
        part = tokens[start:start + chunk].to(torch.int64)
        top = int(part.max())
        if top >= header.vocab_size:
            at = start + int((part >= header.vocab_size).nonzero()[0])
            raise DataError(f"{path}: token {at:,} has id {top}, not below the vocab_size {header.vocab_size} "
                            "its header declares: the file was written with another tokenizer or a wrong header")


def _verified_marker(path, header: TokenFileHeader) -> Path:
    """A file whose existence says this version of the token file (path, size, mtime, hash) was verified."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{header.sha256}"
    cache = os.environ.get("ACCELRUN_CACHE_DIR")
    root = Path(cache) if cache else Path.home() / ".cache" / "accelrun"
    return root / "verified-tokens" / hashlib.sha256(key.encode()).hexdigest()[:32]


def load_tokens(patterns: Sequence[str], *, key: str = "data.paths", verify: bool = False) -> TensorStream:
    """The ``tokens`` source: token files from files or globs, read as one stream in order."""
    files = expand_paths(patterns, key=key)
    headers, segments = [], []
    for f in files:
        header, tokens = open_tokens(f, verify=verify)
        first = headers[0] if headers else header
        if (header.tokenizer, header.vocab_size) != (first.tokenizer, first.vocab_size):
            raise DataError(
                f"{key}: token files disagree: {files[0]} has tokenizer {first.tokenizer!r} with vocab "
                f"{first.vocab_size}, {f} has {header.tokenizer!r} with vocab {header.vocab_size}"
            )
        headers.append(header)
        segments.append(tokens)
    hasher = hashlib.sha256()
    for h in headers:
        hasher.update(bytes.fromhex(h.sha256))
    fingerprint = {
        "source": "tokens",
        "tokenizer": headers[0].tokenizer,
        "vocab_size": headers[0].vocab_size,
        "files": len(files),
        "bytes": sum(h.n_tokens * h.token_bytes for h in headers),
        "tokens": sum(h.n_tokens for h in headers),
        "sha256": short_hash(hasher),
    }
    return TensorStream(segments, vocab_size=headers[0].vocab_size, fingerprint=fingerprint)


def write_token_file(path: str | os.PathLike, tokens: torch.Tensor, *, vocab_size: int, tokenizer: str,
                     ) -> TokenFileHeader:
    """Write a 1-D uint16 or int32 tensor of ids as a token file, atomically (a temporary file, then
    ``os.replace``). int32 ids are stored as 4-byte tokens (the same bits as uint32 below 2**31)."""
    _check_little_endian()
    token_bytes = {torch.uint16: 2, torch.int32: 4}[tokens.dtype]
    payload = tokens.contiguous().view(torch.uint8).numpy().tobytes() if tokens.numel() else b""
    header = TokenFileHeader(token_bytes, vocab_size, tokens.numel(), tokenizer, hashlib.sha256(payload).hexdigest())
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(header.pack())
            fh.write(payload)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return header


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
    _check_little_endian()
    tok = get_tokenizer(tokenizer, key=tokenizer_key)
    out = Path(output)
    # An output inside an input glob (``data/*`` -> ``data/x.tok``) must not be read as text.
    files = [f for f in expand_paths(inputs, key="inputs") if os.path.abspath(f) != os.path.abspath(out)]
    if not files:
        raise DataError(f"inputs: no text files besides the output {str(out)!r}")
    plan = plan_reads(files, max_bytes)
    total = sum(n for _, n in plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    hasher = hashlib.sha256()
    done = [0]

    def on_bytes(n: int) -> None:
        done[0] = n
        if progress is not None:
            progress(n, total)

    try:
        with open(tmp, "wb") as fh:
            fh.write(b"\0" * HEADER_SIZE)  # placeholder until the count and hash are known
            if isinstance(tok, HFTokenizer):
                n_tokens, token_bytes = _write_encoded(fh, hasher, plan, tok, on_bytes)
            else:
                n_tokens, token_bytes = _write_bytes(fh, hasher, plan, tok.EOS, on_bytes)
            header = TokenFileHeader(token_bytes, tok.vocab_size, n_tokens, tok.name, hasher.hexdigest())
            fh.seek(0)
            fh.write(header.pack())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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


def _separator(tok) -> str:
    if isinstance(tok, HFTokenizer):
        if tok.EOS is None:
            return "nothing (no eos_token in a tokenizer_config.json beside the tokenizer)"
        return f"{tok.info.eos_token} (id {tok.EOS})"
    return f"EOS (id {tok.EOS})"


def _write_bytes(fh, hasher, plan, eos: int, on_bytes: Callable[[int], None]) -> tuple[int, int]:
    """The byte tokenizer: token id == byte value, read straight into the output buffer."""
    writer = _ChunkWriter(fh, hasher, eos)
    done = 0
    for path, n in plan:
        with open(path, "rb") as src:
            left = n
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
    writer.flush()
    return writer.n_tokens, 2


def _write_encoded(fh, hasher, plan, tok: HFTokenizer, on_bytes: Callable[[int], None]) -> tuple[int, int]:
    """A tokenizer.json tokenizer: documents encoded a batch at a time (``hf_documents.encode_files``)."""
    from accelrun.data.hf_documents import encode_files

    token_bytes = 2 if tok.token_dtype == torch.uint16 else 4  # int32 ids < 2**31 have uint32's bits
    n_tokens = 0
    for tokens, _ in encode_files(plan, tok, on_bytes=on_bytes):
        payload = tokens.numpy().tobytes()
        fh.write(payload)
        hasher.update(payload)
        n_tokens += tokens.numel()
    return n_tokens, token_bytes

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
so a data set larger than RAM costs only the pages a run touches. ``write_token_file`` and
``prepare_tokens`` (``prepare.py``, from text files) write a file atomically (a temporary file,
then ``os.replace``): a crash never leaves a half-written file under the real name.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from accelrun.config.data_paths import expand_paths
from accelrun.data.atomic_file import write_bytes_atomic
from accelrun.data.doc_index import read_doc_index
from accelrun.data.errors import DataError
from accelrun.data.stream import TensorStream, short_hash

MAGIC = b"ACCTOK01"
HEADER_SIZE = 128
_HEADER = struct.Struct("<8sHHIQ16s32s")  # the fields above; zeros pad it to HEADER_SIZE
_DTYPES = {2: torch.uint16, 4: torch.uint32}


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


def check_little_endian() -> None:
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


def open_tokens(path: str | os.PathLike, *, verify: bool = False, random_access: bool = True,
                ) -> tuple[TokenFileHeader, torch.Tensor]:
    """The header and a zero-copy tensor view of the tokens of one file (read-only memory map).
    ``random_access``: the reader will read shuffled windows (``data.shuffle``), and the map says so.

    ``verify`` re-hashes the payload, compares it with the header and checks that every id is below
    the header's vocabulary (reads the whole file; remembered per file version in the cache folder)."""
    check_little_endian()
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
    if random_access:  # after verification's two passes in order, which read-ahead serves
        _advise_random(mm)
    return header, tokens


def _advise_random(mm: mmap.mmap) -> None:
    """Tell the kernel the map is read at random. The loader reads shuffled windows (2 KiB for 1,024
    uint16 tokens), and otherwise each page fault on a file not in the page cache reads the fault's
    whole neighbourhood, up to the device's read-ahead (8 MiB on this project's VM disk): on a corpus
    larger than memory every window then cost ~4-6 MiB of reads, 230-370 windows/s against 9,000-15,000
    with this advice (48 GiB of shards, 23 GiB of RAM)."""
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        with contextlib.suppress(OSError):  # advice only
            mm.madvise(mmap.MADV_RANDOM)


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


def load_tokens(patterns: Sequence[str], *, key: str = "data.paths", verify: bool = False,
                random_access: bool = True) -> TensorStream:
    """The ``tokens`` source: token files from files or globs, read as one stream in order
    (``random_access``: in shuffled windows; see ``open_tokens``)."""
    files = expand_paths(patterns, key=key)
    headers, segments, doc_starts = [], [], []
    for f in files:
        header, tokens = open_tokens(f, verify=verify, random_access=random_access)
        first = headers[0] if headers else header
        if (header.tokenizer, header.vocab_size) != (first.tokenizer, first.vocab_size):
            raise DataError(
                f"{key}: token files disagree: {files[0]} has tokenizer {first.tokenizer!r} with vocab "
                f"{first.vocab_size}, {f} has {header.tokenizer!r} with vocab {header.vocab_size}"
            )
        headers.append(header)
        segments.append(tokens)
        doc_starts.append(read_doc_index(f, header.sha256, header.n_tokens))
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
    return TensorStream(segments, vocab_size=headers[0].vocab_size, fingerprint=fingerprint,
                        document_starts=_joined_starts(doc_starts, [h.n_tokens for h in headers]))


def _joined_starts(per_file: list[torch.Tensor | None], lengths: list[int]) -> torch.Tensor | None:
    """The files' document indexes as one, offset by where each file begins; None unless every file
    has one (an empty file adds no document)."""
    if any(s is None for s in per_file):
        return None
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    parts = [s + off for s, off, n in zip(per_file, offsets, lengths, strict=False) if n > 0]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def write_token_file(path: str | os.PathLike, tokens: torch.Tensor, *, vocab_size: int, tokenizer: str,
                     ) -> TokenFileHeader:
    """Write a 1-D uint16 or int32 tensor of ids as a token file, atomically (a temporary file, then
    ``os.replace``). int32 ids are stored as 4-byte tokens (the same bits as uint32 below 2**31)."""
    check_little_endian()
    token_bytes = {torch.uint16: 2, torch.int32: 4}[tokens.dtype]
    payload = tokens.contiguous().view(torch.uint8).numpy().tobytes() if tokens.numel() else b""
    header = TokenFileHeader(token_bytes, vocab_size, tokens.numel(), tokenizer, hashlib.sha256(payload).hexdigest())
    write_bytes_atomic(path, header.pack(), payload)
    return header

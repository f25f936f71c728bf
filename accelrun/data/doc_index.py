"""A token file's document index (``.docs`` beside the ``.tok``): where each document starts.

Layout (little-endian)::

    offset size  field
         0    8  magic      b"ACCDOC01"
         8    8  n_docs
        16   32  sha256     the digest of the token file's payload this index belongs to
        48   16  reserved   zeros
        64   -   starts     n_docs × int64, ascending, starts[0] == 0

The digest pairs the index with its tokens: an index left beside a token file that was written again
would put document boundaries in the wrong places, so it is refused, not trusted. ``data.packing:
document`` reads the starts through ``TokenStream.document_starts``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from accelrun.data.atomic_file import write_bytes_atomic
from accelrun.data.errors import DataError

DOC_MAGIC = b"ACCDOC01"
DOC_HEADER_SIZE = 64
_DOC_HEADER = struct.Struct("<8sQ32s")


def index_path(token_file: str | os.PathLike) -> Path:
    """Where the index of ``token_file`` lives: the same name with ``.docs`` for ``.tok``."""
    return Path(token_file).with_suffix(".docs")


def write_doc_index(token_file: str | os.PathLike, starts: torch.Tensor, tokens_sha256: str) -> Path:
    """Write ``starts`` (int64 offsets) as the index of the token file whose payload digest (its
    header's ``sha256``) is ``tokens_sha256``, atomically (temporary name, then ``os.replace``)."""
    payload = starts.to(torch.int64).contiguous().numpy().tobytes()
    head = _DOC_HEADER.pack(DOC_MAGIC, starts.numel(), bytes.fromhex(tokens_sha256)).ljust(DOC_HEADER_SIZE, b"\0")
    return write_bytes_atomic(index_path(token_file), head, payload)


def read_doc_index(token_file: str | os.PathLike, tokens_sha256: str, n_tokens: int) -> torch.Tensor | None:
    """The document starts of ``token_file`` (its header's digest and token count), or None when it has
    no index."""
    path = index_path(token_file)
    if not path.is_file():
        return None
    data = path.read_bytes()
    if len(data) < DOC_HEADER_SIZE or data[:8] != DOC_MAGIC:
        raise DataError(f"{path}: not an accelrun document index (starts with {data[:8]!r}, expected {DOC_MAGIC!r})")
    _, n_docs, digest = _DOC_HEADER.unpack_from(data)
    if digest.hex() != tokens_sha256:
        raise DataError(f"{path}: this document index belongs to other tokens than {token_file}'s (the token file "
                        "was written again since): prepare the data again, or delete the .docs file")
    if len(data) != DOC_HEADER_SIZE + 8 * n_docs:
        raise DataError(f"{path}: truncated document index ({len(data)} bytes for {n_docs} documents)")
    starts = torch.frombuffer(bytearray(data[DOC_HEADER_SIZE:]), dtype=torch.int64) if n_docs else \
        torch.empty(0, dtype=torch.int64)
    if n_docs and (int(starts[0]) != 0 or int(starts[-1]) >= max(n_tokens, 1)):
        raise DataError(f"{path}: document starts outside the {n_tokens} tokens of {token_file}")
    return starts

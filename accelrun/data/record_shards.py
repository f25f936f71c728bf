"""Record files into token shards: the unit of work of ``accelrun data prepare --workers N`` and of the
``documents`` source.

A corpus is cut into pieces that depend on the data alone, never on the number of workers: a jsonl
file into byte ranges of ``PIECE_BYTES`` (each line belongs to the range it begins in), a parquet
file into its row groups, any other file whole. Piece ``k`` becomes shard ``k`` (``shard-0000k.tok``
with its document index ``shard-0000k.docs``), so one worker and eight write the same files.
A worker needs only the piece and the tokenizer's name, and writes under a temporary name.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from accelrun.data.doc_index import write_doc_index
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.records import (
    RecordBatch,
    RecordFile,
    RecordFormat,
    _read_json_lines,
    pyarrow_module,
    read_file,
)
from accelrun.data.tokenizer import ByteTokenizer, get_tokenizer
from accelrun.data.tokfile import HEADER_SIZE, TokenFileHeader

# A jsonl file is cut into 16 pieces (for 16 workers' worth of parallelism) of 4 to 64 MiB: the size
# depends on the file alone, so the shards do not depend on --workers; 64 MiB keeps a 1 TB corpus at
# 16k memory maps, well inside Linux's default 65,530 per process.
PIECE_BYTES = 64 << 20
MIN_PIECE_BYTES = 4 << 20
PIECES_PER_FILE = 16


@dataclass(frozen=True)
class Piece:
    """Part of one record file: a byte range of a jsonl file, a parquet row group, or the whole file."""

    index: int  # its shard number, in corpus order
    file: RecordFile
    size: int  # input bytes it covers (progress)
    byte_range: tuple[int, int] | None = None
    row_group: int | None = None
    first_row: int = 0  # parquet: rows in the row groups before this one

    @property
    def shard_name(self) -> str:
        return f"shard-{self.index:05d}.tok"


@dataclass(frozen=True)
class ShardSpec:
    """What a worker needs besides its piece (picklable: crosses to worker processes)."""

    tokenizer: str  # byte, or a tokenizer.json / folder
    text_field: str
    folder: str  # where shards are written
    key: str = "data.paths"
    text_key: str = "data.text_field"


@dataclass(frozen=True)
class ShardResult:
    index: int
    shard: str | None  # None: the piece held no document
    documents: int
    tokens: int
    bytes: int


def plan_pieces(files: Sequence[RecordFile]) -> list[Piece]:
    pieces: list[Piece] = []
    for f in files:
        size = os.path.getsize(f.path)
        if f.format is RecordFormat.JSONL or (f.format is RecordFormat.JSON and not _is_json_array(f.path)):
            step = min(PIECE_BYTES, max(MIN_PIECE_BYTES, size // PIECES_PER_FILE))
            for start in range(0, max(size, 1), step):
                stop = min(start + step, size)
                pieces.append(Piece(len(pieces), f, stop - start, byte_range=(start, stop)))
        elif f.format is RecordFormat.PARQUET:
            meta = pyarrow_module(f).parquet.ParquetFile(f.path).metadata
            rows = 0
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                pieces.append(Piece(len(pieces), f, group.total_byte_size, row_group=g, first_row=rows))
                rows += group.num_rows
        else:
            pieces.append(Piece(len(pieces), f, size))
    return pieces


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4096).lstrip().startswith(b"[")


def read_piece(piece: Piece, columns: Sequence[str], column_key: str | None) -> Iterator[RecordBatch]:
    f = piece.file
    if piece.byte_range is not None:
        yield from _read_json_lines(f, list(columns), column_key, 1024, piece.byte_range)
    elif piece.row_group is not None:
        pf = pyarrow_module(f).parquet.ParquetFile(f.path)
        first = piece.first_row
        for b in pf.iter_batches(batch_size=1024, row_groups=[piece.row_group], columns=list(columns)):
            yield RecordBatch(f, {c: b.column(c).to_pylist() for c in columns}, None, first)
            first += b.num_rows
    else:
        yield from read_file(f, columns, column_key=column_key)


_TOKENIZERS: dict[str, ByteTokenizer | HFTokenizer] = {}


def _tokenizer(name: str) -> ByteTokenizer | HFTokenizer:
    if name not in _TOKENIZERS:  # once per worker process
        _TOKENIZERS[name] = get_tokenizer(name)
    return _TOKENIZERS[name]


def encode_texts(texts: Sequence[str], tok: ByteTokenizer | HFTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(the documents' tokens, each followed by the end-of-text id, as one array; each one's length)."""
    if isinstance(tok, HFTokenizer):
        docs = tok.encode_documents(texts)
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        dtype = np.uint16 if tok.token_dtype == torch.uint16 else np.int32
        return np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum())), lengths
    raw = [t.encode("utf-8", errors="replace") for t in texts]
    lengths = np.fromiter((len(r) + 1 for r in raw), dtype=np.int64, count=len(raw))
    out = np.empty(int(lengths.sum()), dtype=np.uint16)
    is_text = np.ones(out.size, dtype=bool)
    is_text[np.cumsum(lengths) - 1] = False  # the EOS after each document
    out[is_text] = np.frombuffer(b"".join(raw), dtype=np.uint8)
    out[~is_text] = ByteTokenizer.EOS
    return out, lengths


def write_shard(piece: Piece, spec: ShardSpec, on_batch: Callable[[int, int], None] | None = None) -> ShardResult:
    """Encode ``piece``'s documents (empty texts left out: they would add a lone end-of-text) into
    ``spec.folder/piece.shard_name`` and its index. Tokens go to the file a batch at a time, so memory
    holds one batch of records whatever the piece's size. ``on_batch(bytes, tokens)`` reports progress."""
    tok = _tokenizer(spec.tokenizer)
    path = Path(spec.folder) / piece.shard_name
    tmp = path.with_name(f".{path.name}.tmp")
    hasher = hashlib.sha256()
    lengths: list[np.ndarray] = []
    n_tokens, token_bytes = 0, 2
    with open(tmp, "wb") as fh:
        fh.write(b"\0" * HEADER_SIZE)  # placeholder until the count and hash are known
        for batch in read_piece(piece, [spec.text_field], spec.text_key):
            texts = [t for i in range(len(batch)) if (t := batch.text(spec.text_field, i, key=spec.text_key))]
            if not texts:
                continue
            tokens, doc_lengths = encode_texts(texts, tok)
            payload = tokens.tobytes()
            fh.write(payload)
            hasher.update(payload)
            token_bytes = tokens.itemsize
            n_tokens += tokens.size
            lengths.append(doc_lengths)
            if on_batch is not None:
                on_batch(sum(len(t) for t in texts), tokens.size)
        header = TokenFileHeader(token_bytes, tok.vocab_size, n_tokens, tok.name, hasher.hexdigest())
        fh.seek(0)
        fh.write(header.pack())
    if not lengths:
        tmp.unlink()
        return ShardResult(piece.index, None, 0, 0, piece.size)
    os.replace(tmp, path)
    doc_lengths = np.concatenate(lengths)
    starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64)
    write_doc_index(path, torch.from_numpy(starts), header.sha256)
    return ShardResult(piece.index, piece.shard_name, int(doc_lengths.size), n_tokens, piece.size)

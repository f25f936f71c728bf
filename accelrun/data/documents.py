"""The ``documents`` source: the text column of record files (jsonl, json, csv, parquet, Arrow,
save_to_disk folders) as one token stream, one end-of-text after each document.

The corpus is prepared once into the cache folder (``$ACCELRUN_CACHE_DIR/documents/<key>``, the shards
``accelrun data prepare`` writes) and memory-mapped from there, so a corpus larger than memory trains
in bounded memory and later runs start at once. The key covers the tokenizer, the text field and each
file's path, size and mtime. The first rank to get the lock prepares; the others wait and map the
result. A cache folder that cannot be written costs only the time: the shards go to a temporary
folder that is removed once mapped.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from accelrun.data.encoded_cache import _locked, cache_root
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.prepare_records import MANIFEST, prepare_records, read_manifest
from accelrun.data.records import record_files
from accelrun.data.stream import TensorStream
from accelrun.data.tokenizer import ByteTokenizer
from accelrun.data.tokfile import load_tokens


def documents_key(paths: Sequence[str], tokenizer_name: str, text_field: str) -> str:
    h = hashlib.sha256(f"documents/1|{tokenizer_name}|{text_field}".encode())
    for f in record_files(paths):
        st = os.stat(f.path)
        h.update(f"|{os.path.abspath(f.path)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def load_documents(paths: Sequence[str], *, tokenizer: ByteTokenizer | HFTokenizer, tokenizer_spec: str,
                   text_field: str, random_access: bool = True) -> TensorStream:
    """``data.paths``' records, ``text_field`` of each, in ``tokenizer``'s tokens (``tokenizer_spec`` is
    what ``data.tokenizer`` says: byte, or the tokenizer.json path)."""
    folder = cache_root().parent / "documents" / documents_key(paths, tokenizer.name, text_field)

    def prepare(into: Path) -> None:
        prepare_records(paths, into, tokenizer=tokenizer_spec, text_field=text_field, workers=1,
                        progress=PreparingNote(), key="data.paths", tokenizer_key="data.tokenizer",
                        text_key="data.text_field")

    with _locked(folder.with_name(folder.name + ".lock")) as writable:
        if writable:
            if not (folder / MANIFEST).is_file():
                prepare(folder)
            return _stream(folder, random_access)
    scratch = Path(tempfile.mkdtemp(prefix="accelrun-documents-"))
    try:
        prepare(scratch / "corpus")
        return _stream(scratch / "corpus", random_access)  # memory maps keep the removed files readable
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class PreparingNote:
    """Says on stderr, every ``every_s`` seconds once preparing has taken that long, how far the first
    preparation of a corpus has got: a large corpus takes minutes before the first step, once."""

    def __init__(self, every_s: float = 10.0, clock=time.monotonic, out=None) -> None:
        self.every_s, self.clock, self.out = every_s, clock, out
        self.start = self.last = clock()

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        mib, seconds = 2**20, max(now - self.start, 1e-9)
        print(f"preparing data.paths into the cache (once; later runs map it): {done / mib:,.0f} of "
              f"{total / mib:,.0f} MiB ({done / max(total, 1):.0%}), {done / mib / seconds:.1f} MiB/s, "
              f"{tokens:,} tokens", file=self.out or sys.stderr, flush=True)


def _stream(folder: Path, random_access: bool) -> TensorStream:
    manifest = read_manifest(folder)
    tokens = load_tokens([str(folder)], random_access=random_access)
    fingerprint = {"source": "documents", "tokenizer": manifest["tokenizer"], "text_field": manifest["text_field"],
                   "files": manifest["files"], "documents": manifest["documents"], "tokens": manifest["tokens"],
                   "sha256": manifest["sha256"]}  # of the tokens and boundaries: the same for any format
    return TensorStream(tokens.segments, vocab_size=tokens.vocab_size, fingerprint=fingerprint,
                        document_starts=tokens.document_starts)

"""Encoded text, kept in the cache folder as a token file that runs memory-map.

A BPE encodes a few MiB a second per core, and every rank of a job encodes the same corpus; the byte
tokenizer reads text at memory speed, but each rank would hold its own copy of the tokens (two bytes a
byte of text). So the first process to need an encoding writes it under
``$ACCELRUN_CACHE_DIR/encoded-text/`` (default ``~/.cache/accelrun``) while holding a lock; it and the
other ranks memory-map the file (one copy in the page cache for all of them), and later runs start at
once. The key covers the tokenizer (its name hashes tokenizer.json and its EOS), ``max_bytes`` and each
file's path, size, mtime, change time and inode, so an edited file or another tokenizer is encoded
afresh. A cache folder that cannot be written costs only the time and memory: the text is then encoded
in this process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from accelrun.data.doc_index import read_doc_index, write_doc_index
from accelrun.data.stream import TensorStream
from accelrun.data.tokfile import open_tokens, write_token_file


def cache_root() -> Path:
    cache = os.environ.get("ACCELRUN_CACHE_DIR")
    return (Path(cache) if cache else Path.home() / ".cache" / "accelrun") / "encoded-text"


def cache_key(tokenizer_name: str, plan: Sequence[tuple[Path, int]], max_bytes: int | None, fingerprint: dict,
              ) -> str:
    """What decides the tokens: the tokenizer, each file read (path, bytes read, size, mtime, change time,
    inode), the cap,
    and the source's own fingerprint fields (builtin and text over the same files stay apart)."""
    h = hashlib.sha256(f"{tokenizer_name}|{max_bytes}|{json.dumps(fingerprint, sort_keys=True)}".encode())
    for path, n in plan:
        st = os.stat(path)
        # (the change time and inode too: an edit that keeps size and mtime, by `touch -r` or a copy keeping
        # times, was read from the old tokens; nobody can set those two)
        h.update(f"|{os.path.abspath(path)}|{n}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}".encode())
    return h.hexdigest()[:32]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """An exclusive lock on ``path`` (True), or False where the cache folder cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a")
    except OSError:
        yield False
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
        except OSError:  # a file system without locks: each process encodes for itself
            yield False
            return
        yield True


def cached_stream(key: str, encode: Callable[[], TensorStream]) -> TensorStream:
    """The stream cached under ``key``, or ``encode()``'s, which is then cached and read back
    memory-mapped: its pages are then the page cache's, one copy shared by every rank and run on this
    machine and reclaimable, not a private copy in each process (a 64 MiB corpus is 128 MiB of tokens)."""
    root = cache_root()
    tok_path, meta_path = root / f"{key}.tok", root / f"{key}.json"
    with _locked(root / f"{key}.lock") as writable:
        if writable and (hit := _load(tok_path, meta_path)) is not None:
            return hit
        stream = encode()
        if writable and _store(stream, tok_path, meta_path):
            return _load(tok_path, meta_path) or stream
        return stream


def _load(tok_path: Path, meta_path: Path) -> TensorStream | None:
    if not (meta_path.is_file() and tok_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        header, tokens = open_tokens(tok_path)
        starts = read_doc_index(tok_path, header.sha256, header.n_tokens)
        # An entry cached before document indexes existed is encoded again, to gain one.
        if header.sha256 == meta["sha256"] and (starts is not None or header.n_tokens == 0):
            return TensorStream([tokens], vocab_size=header.vocab_size, fingerprint=meta["fingerprint"],
                                document_starts=starts)
    except (OSError, ValueError, KeyError):  # DataError is a ValueError
        pass  # damaged: encoded again
    return None


def _store(stream: TensorStream, tok_path: Path, meta_path: Path) -> bool:
    """Write ``stream`` under the cache's names (the metadata last: an entry without it is not one)."""
    try:
        header = write_token_file(tok_path, stream.tokens, vocab_size=stream.vocab_size,
                                  tokenizer=stream.fingerprint["tokenizer"])
        if stream.document_starts is not None:
            write_doc_index(tok_path, stream.document_starts, header.sha256)
        tmp = meta_path.with_name(f".{meta_path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"sha256": header.sha256, "fingerprint": stream.fingerprint}))
        os.replace(tmp, meta_path)
    except OSError:
        return False
    return True

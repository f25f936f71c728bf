"""``prepare_records``: a corpus of record files (jsonl, json, csv, parquet, Arrow, save_to_disk) into a
folder of memory-mappable token shards with document indexes, on ``workers`` processes.

The folder::

    prepared.json       what was read and how: tokenizer, text field, shards in order, counts
    shard-00000.tok     tokens (tokfile's format)      shard-00000.docs  where each document starts
    ...

``data.source: tokens`` with ``data.paths: [the folder]`` trains on it; the ``documents`` source
prepares into its cache the same way. Nothing is written half: shards go to a hidden temporary folder
beside the output, renamed into place once every shard and ``prepared.json`` are complete, so an
interrupted prepare leaves nothing that a run (or a glob) would read.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

from accelrun.data.atomic_file import hold, release, remove_dead_scratch, scratch_path
from accelrun.data.doc_index import read_doc_index
from accelrun.data.errors import DataError
from accelrun.data.record_shards import Piece, ShardResult, ShardSpec, plan_pieces, write_shard
from accelrun.data.records import file_names, record_files
from accelrun.data.stream import short_hash
from accelrun.data.tokenizer import get_tokenizer
from accelrun.data.tokfile import HEADER_SIZE, check_little_endian, read_header
from accelrun.report.machine_load import usable_cores

MANIFEST = "prepared.json"
MANIFEST_FORMAT = "accelrun-prepared/1"

# (input bytes done, input bytes in all, tokens written so far)
RecordProgress = Callable[[int, int, int], None]


@dataclass(frozen=True)
class PreparedCorpus:
    path: str
    files: int
    shards: int
    documents: int
    tokens: int
    bytes: int
    tokenizer: str
    vocab_size: int
    text_field: str


def prepare_records(
    inputs: Sequence[str], output: str | os.PathLike, *, tokenizer: str = "byte", text_field: str = "text",
    workers: int = 1, progress: RecordProgress | None = None, key: str = "inputs",
    tokenizer_key: str = "--tokenizer", text_key: str = "--text-field",
) -> PreparedCorpus:
    """Tokenize the records' ``text_field`` into shards under the folder ``output`` (replaced if it
    holds an earlier prepare). One worker runs in this process; more run as processes, each encoding
    whole pieces, and the shards are the same either way.

    >>> prepare_records(["corpus/*.parquet"], "data/corpus", workers=4)  # doctest: +SKIP
    PreparedCorpus(path='data/corpus', files=8, shards=31, documents=1200000, tokens=..., ...)
    """
    check_little_endian()
    tok = get_tokenizer(tokenizer, key=tokenizer_key)  # a bad tokenizer fails before any reading
    out = Path(output)
    _check_output(out)
    files = record_files(inputs, key=key)
    pieces = plan_pieces(files)
    total = sum(p.size for p in pieces)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_scratch(out)  # what a killed prepare of this folder left
    tmp = scratch_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    held = hold(tmp)  # until renamed into place: a later prepare leaves it alone while this one lives
    spec = ShardSpec(tokenizer, text_field, str(tmp), key=key, text_key=text_key)
    try:
        results = _run(pieces, spec, workers, total, progress)
        shards = [r.shard for r in results if r.shard is not None]
        documents = sum(r.documents for r in results)
        if documents == 0:
            raise DataError(f"{key}: the corpus is empty: no record of {file_names(files)} has text in {text_key} "
                            f"{text_field!r}")
        summary = PreparedCorpus(str(out), len(files), len(shards), documents, sum(r.tokens for r in results), total,
                                 tok.name, tok.vocab_size, text_field)
        manifest = {"format": MANIFEST_FORMAT, **asdict(summary), "shards": shards,
                    "sha256": content_hash(tmp, shards), "inputs": [str(f.path) for f in files]}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        release(held)
    return summary


def content_hash(folder: Path, shards: Sequence[str]) -> str:
    """A hash of the tokens and document boundaries, independent of how they were cut into shards: the
    same documents as jsonl or parquet (different pieces) get the same one, so runs on them compare."""
    tokens, boundaries = hashlib.sha256(), hashlib.sha256()  # two streams: a cut must not reorder them
    offset = 0
    for name in shards:
        path = folder / name
        header = read_header(path)
        starts = read_doc_index(path, header.sha256, header.n_tokens)
        boundaries.update((starts + offset).numpy().tobytes())
        with open(path, "rb") as fh:
            fh.seek(HEADER_SIZE)
            while chunk := fh.read(16 << 20):
                tokens.update(chunk)
        offset += header.n_tokens
    return short_hash(hashlib.sha256(tokens.digest() + boundaries.digest()))


def _check_output(out: Path) -> None:
    if out.suffix == ".tok":
        raise DataError(f"-o: record files prepare into a folder of shards, not one token file: give a folder, "
                        f"e.g. {str(out.with_suffix(''))!r}")
    if out.exists() and not (out.is_dir() and ((out / MANIFEST).is_file() or not any(out.iterdir()))):
        raise DataError(f"-o: {str(out)!r} exists and is not an earlier prepare's folder: name a new folder")


def _move_into_place(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; an earlier prepare there is removed only once the new one is in place."""
    old = scratch_path(out, "old")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _run(pieces: list[Piece], spec: ShardSpec, workers: int, total: int,
         progress: RecordProgress | None) -> list[ShardResult]:
    done = {"bytes": 0, "tokens": 0}

    def report(n_bytes: int, n_tokens: int) -> None:
        done["bytes"] += n_bytes
        done["tokens"] += n_tokens
        if progress is not None:
            progress(min(done["bytes"], total), total, done["tokens"])

    if workers <= 1 or len(pieces) <= 1:
        results = []
        for p in pieces:
            # Text read stands in for file bytes while a piece is encoded (capped at its size), and the
            # rest is settled at its end: text and file sizes differ (escapes, compression).
            counted = [0]

            def on_batch(text_bytes: int, tokens: int, p: Piece = p, counted: list[int] = counted) -> None:
                step = min(text_bytes, p.size - counted[0])
                counted[0] += step
                report(step, tokens)

            results.append(write_shard(p, spec, on_batch=on_batch))
            report(p.size - counted[0], 0)
        return results
    # fork where there is one: a worker starts in milliseconds with accelrun already imported (spawn and
    # forkserver import torch again, seconds on a busy machine). This process has encoded nothing yet,
    # so no tokenizer thread pool is copied half-way through its work.
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    results: list[ShardResult] = []
    n = min(workers, len(pieces))
    with ProcessPoolExecutor(max_workers=n, mp_context=context, initializer=_share_cores,
                             initargs=(max(1, usable_cores() // n),)) as pool:  # fmt: skip
        futures = [pool.submit(write_shard, p, spec) for p in pieces]
        try:
            for fut in as_completed(futures):
                r = fut.result()
                results.append(r)
                report(r.bytes, r.tokens)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return sorted(results, key=lambda r: r.index)


def _share_cores(threads: int) -> None:
    """A worker's share of the cores for the tokenizer's own thread pool (Rust's rayon, sized on first
    use from ``RAYON_NUM_THREADS``): each worker would otherwise start one thread per core, N workers N
    threads a core. Encoding is most of the work (91% of one worker's time, bench/data_prepare.py), and
    the pool already spreads one worker's batches over every core: workers add what the pool leaves
    serial (reading and parsing records, writing shards)."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)


def read_manifest(folder: str | os.PathLike) -> dict:
    """A prepared folder's ``prepared.json``."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the prepared folder's manifest ({e})") from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path}: format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}; prepare it again")
    return manifest

"""accelrun data prepare on record files: shards + document indexes that --workers 2 writes byte for
byte as 1 does, the tokens a Hugging Face tokenizer gives the same texts, nothing a run would read left
by an interrupted prepare, and a prepared folder that trains as data.source = tokens."""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config.schema import DataConfig
from accelrun.data import DataError, load_stream
from accelrun.data.atomic_file import hold, release, remove_dead_scratch, scratch_path
from accelrun.data.doc_index import index_path
from accelrun.data.prepare_records import prepare_records
from accelrun.data.tokfile import load_tokens, write_token_file
from tests.conftest import DEFAULT_CONFIG
from tests.data.test_documents import DOCS, write_corpus

pytest.importorskip("pyarrow", reason="the data extra (pyarrow) is not installed")


@pytest.fixture()
def small_pieces(monkeypatch):
    """Pieces of 2 KiB: a small jsonl file becomes several shards, as a large one does at 64 MiB."""
    monkeypatch.setattr("accelrun.data.record_shards.PIECE_BYTES", 2048)


def test_two_workers_write_the_shards_one_writes(tmp_path, small_pieces):
    inputs = [str(write_corpus(tmp_path / "j", "jsonl")), str(write_corpus(tmp_path / "p", "parquet"))]
    one = prepare_records(inputs, tmp_path / "one", workers=1)
    two = prepare_records(inputs, tmp_path / "two", workers=2)
    assert one.shards == two.shards > 4 and one.documents == 2 * len(DOCS)
    names = sorted(os.listdir(tmp_path / "one"))
    assert names == sorted(os.listdir(tmp_path / "two"))
    assert sum(n.endswith(".docs") for n in names) == one.shards
    for name in names:
        if name != "prepared.json":
            assert filecmp.cmp(tmp_path / "one" / name, tmp_path / "two" / name, shallow=False), name
    manifests = [json.loads((tmp_path / d / "prepared.json").read_text()) for d in ("one", "two")]
    assert [{k: v for k, v in m.items() if k != "path"} for m in manifests][0] == \
        {k: v for k, v in manifests[1].items() if k != "path"}


def test_prepared_folder_trains_as_tokens_with_the_documents_sources_stream(tmp_path, small_pieces):
    corpus = write_corpus(tmp_path / "c", "jsonl")
    prepare_records([str(corpus)], tmp_path / "prepared", workers=2)
    prepared = load_stream(DataConfig(source="tokens", paths=[str(tmp_path / "prepared")]), vocab_size=320, seed=0)
    direct = load_stream(DataConfig(source="documents", paths=[str(corpus)]), vocab_size=320, seed=0)
    assert torch.equal(prepared.read(0, len(prepared)), direct.read(0, len(direct)))
    assert torch.equal(prepared.document_starts, direct.document_starts)
    assert prepared.document_starts.numel() == len(DOCS)


def test_shards_hold_what_transformers_encodes(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from tests.data.test_data_hf_tokenizer import _save_folder, _train_bpe

    folder = _save_folder(_train_bpe(), tmp_path / "tok")
    corpus = write_corpus(tmp_path / "c", "parquet")
    prepare_records([str(corpus)], tmp_path / "bpe", tokenizer=str(folder), workers=2)
    stream = load_tokens([str(tmp_path / "bpe")])
    hf = AutoTokenizer.from_pretrained(folder)
    encoded = hf([d["text"] for d in DOCS])["input_ids"]  # the batch encoding datasets.map would call
    expected = [i for ids in encoded for i in ids + [hf.eos_token_id]]
    assert stream.read(0, len(stream)).tolist() == expected
    lengths = torch.tensor([len(ids) + 1 for ids in encoded])
    assert stream.document_starts.tolist() == [0, *lengths.cumsum(0)[:-1].tolist()]


def test_an_interrupted_prepare_leaves_nothing_a_run_would_read(tmp_path, monkeypatch, small_pieces):
    corpus = write_corpus(tmp_path / "c", "jsonl")
    out = tmp_path / "data" / "corpus"
    before = prepare_records([str(corpus)], out)
    import accelrun.data.prepare_records as module

    real, calls = module.write_shard, []

    def dies_on_the_third_piece(piece, spec, on_batch=None):
        calls.append(piece.index)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(piece, spec, on_batch)

    monkeypatch.setattr(module, "write_shard", dies_on_the_third_piece)
    with pytest.raises(KeyboardInterrupt):
        prepare_records([str(corpus)], out)
    assert calls == [0, 1, 2]
    assert os.listdir(tmp_path / "data") == ["corpus"]  # no temporary folder left beside it
    again = load_tokens([str(out)])  # the earlier prepare, whole
    assert again.fingerprint["tokens"] == before.tokens and again.document_starts.numel() == len(DOCS)


def _big_corpus(path: Path, mib: int) -> Path:
    """A jsonl file large enough (several 4 MiB pieces, about a second to prepare) to be killed half way."""
    line = json.dumps({"text": "the quick brown fox jumps over the lazy dog. " * 40}) + "\n"
    with open(path, "w") as fh:
        fh.write(line * (mib * 2**20 // len(line)))
    return path


def _kill_once_writing(argv: list[str], scratch_parent: Path, log: Path) -> None:
    """Start ``accelrun argv`` in its own process group and SIGKILL the group (workers included) as soon
    as a shard is being written under a scratch folder in ``scratch_parent``: no handler runs."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "from accelrun.cli.main import cli; cli()", *argv],
                                start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    deadline, seen = time.monotonic() + 120, False
    try:
        while not seen and time.monotonic() < deadline and proc.poll() is None:
            try:
                seen = any(p.name.startswith(("shard-", ".shard-"))
                           for d in scratch_parent.glob(".*.tmp-*") if d.is_dir() for p in d.iterdir())
            except OSError:  # renamed or removed between the listing and the look inside
                pass
            time.sleep(0.005)
        assert seen and proc.poll() is None, f"not killed while writing shards: {log.read_text()[-2000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _wait_unlocked(scratch_parent.glob(".*.tmp-*"))  # its workers die a moment later, and let go of it then


def _wait_unlocked(paths, timeout_s: float = 30) -> None:
    import fcntl

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            end = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    assert time.monotonic() < end, f"{path} still locked {timeout_s} s after its writer was killed"
                    time.sleep(0.01)
        finally:
            os.close(fd)


def test_a_killed_prepare_with_two_workers_leaves_nothing_a_run_would_read(tmp_path):
    data = tmp_path / "data"
    earlier = prepare_records([str(write_corpus(tmp_path / "small", "jsonl"))], data / "corpus")
    big = _big_corpus(tmp_path / "big.jsonl", mib=32)
    _kill_once_writing(["data", "prepare", str(big), "-o", str(data / "corpus"), "--workers", "2"], data,
                       tmp_path / "prepare.log")
    (left,) = [p for p in data.iterdir() if p.name != "corpus"]  # the killed prepare's scratch, hidden
    assert left.name.startswith(".corpus.tmp-")
    for paths in ([str(data / "corpus")], [f"{data}/*"]):  # the earlier prepare, whole; a glob skips the scratch
        again = load_tokens(paths)
        assert again.fingerprint["tokens"] == earlier.tokens and again.document_starts.numel() == len(DOCS), paths
    prepare_records([str(write_corpus(tmp_path / "small", "jsonl"))], data / "corpus")  # the next prepare
    assert os.listdir(data) == ["corpus"]  # removed what the dead one left


def test_a_run_killed_while_it_prepares_documents_leaves_no_cache_a_run_would_trust(tmp_path, monkeypatch):
    big = _big_corpus(tmp_path / "big.jsonl", mib=32)
    monkeypatch.setenv("ACCELRUN_CACHE_DIR", str(tmp_path / "cache"))
    documents = tmp_path / "cache" / "documents"  # where the documents source prepares (documents.py)
    documents.mkdir(parents=True)
    _kill_once_writing(["train", str(DEFAULT_CONFIG), "train.steps=1", "data.source=documents", f"data.paths=[{big}]",
                        f"report.runs_dir={tmp_path / 'runs'}", "compile.backend=eager"], documents,
                       tmp_path / "train.log")
    assert not any((d / "prepared.json").exists() for d in documents.iterdir())
    stream = load_stream(DataConfig(source="documents", paths=[str(big)]), vocab_size=320, seed=0)
    whole = prepare_records([str(big)], tmp_path / "whole")
    assert len(stream) == whole.tokens and stream.document_starts.numel() == whole.documents  # prepared again
    left = [p.name for p in documents.iterdir() if not p.name.endswith(".lock")]
    assert len(left) == 1 and (documents / left[0] / "prepared.json").exists(), left  # no scratch left


def test_scratch_a_live_writer_holds_is_left_alone(tmp_path):
    out = tmp_path / "corpus"
    live = scratch_path(out)
    live.mkdir()
    (live / "shard-00000.tok").write_bytes(b"x")
    held = hold(live)
    try:
        assert remove_dead_scratch(out) == [] and live.exists()  # another writer's lock (another host, PID namespace)
    finally:
        release(held)
    assert remove_dead_scratch(out) == [live] and not live.exists()


def test_a_document_index_of_other_tokens_is_refused(tmp_path):
    tok = tmp_path / "a.tok"
    header = write_token_file(tok, torch.arange(10, dtype=torch.int32), vocab_size=320, tokenizer="byte")
    from accelrun.data.doc_index import write_doc_index

    write_doc_index(tok, torch.tensor([0, 4]), header.sha256)
    assert load_tokens([str(tok)]).document_starts.tolist() == [0, 4]
    write_token_file(tok, torch.arange(12, dtype=torch.int32), vocab_size=320, tokenizer="byte")  # tokens rewritten
    with pytest.raises(DataError, match=f"{index_path(tok)}: this document index belongs to other tokens"):
        load_tokens([str(tok)])


def test_cli_prepare_with_workers_reports_throughput(tmp_path, small_pieces):
    corpus = write_corpus(tmp_path / "c", "save_to_disk")
    r = CliRunner().invoke(cli, ["data", "prepare", str(corpus), "-o", str(tmp_path / "out"), "--workers", "2"])
    assert r.exit_code == 0, r.output
    assert "documents" in r.output and f"{len(DOCS):,}" in r.output and "tokens/s (2 workers)" in r.output
    manifest = json.loads((tmp_path / "out" / "prepared.json").read_text())
    assert manifest["documents"] == len(DOCS) and len(manifest["shards"]) == 2  # one per Arrow file
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 1}\n')
    r = CliRunner().invoke(cli, ["data", "prepare", str(bad), "-o", str(tmp_path / "bad")])
    assert r.exit_code == 2 and r.output.splitlines() == [f"error: {bad}:2: --text-field 'text' is int 1, not text"]
    assert not (tmp_path / "bad").exists() and not any(p.name.startswith(".bad") for p in Path(tmp_path).iterdir())

"""data.source = documents: the same documents as jsonl, json, csv, parquet, .arrow and a save_to_disk
folder (written here by the libraries teams use: pyarrow, datasets) give the same token stream and the
same document index, and train to the same losses; each bad input is one line, exit 2."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config.schema import DataConfig
from accelrun.data import DataError, load_stream
from accelrun.data.records import iter_records
from accelrun.data.tokenizer import ByteTokenizer
from tests.conftest import DEFAULT_CONFIG

pa = pytest.importorskip("pyarrow", reason="the data extra (pyarrow) is not installed")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (test extra)")

# Varied lengths, non-ASCII text, a comma, a quote and a newline inside a document (csv must keep them).
DOCS = [{"id": i, "text": f"doc {i}: caf\u00e9, \"quoted\"\nsecond line " + "word " * (i % 13) + "\u2713" * (i % 3)}
        for i in range(160)]
FORMATS = ["jsonl", "json", "csv", "parquet", "arrow", "save_to_disk"]


def write_corpus(root: Path, fmt: str, docs: list[dict] = DOCS) -> Path:
    """``docs`` as one corpus of ``fmt``; returns what data.paths names."""
    root.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(docs)
    if fmt == "jsonl":
        path = root / "corpus.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    elif fmt == "json":
        path = root / "corpus.json"
        path.write_text(json.dumps(docs))
    elif fmt == "csv":
        path = root / "corpus.csv"
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(docs[0]))
            writer.writeheader()
            writer.writerows(docs)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        path = root / "corpus.parquet"
        pq.write_table(table, path, row_group_size=50)  # several row groups: several prepare pieces
    elif fmt == "arrow":
        path = root / "corpus.arrow"
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table, max_chunksize=40)
    else:
        path = root / "saved"
        datasets.Dataset.from_list(docs).save_to_disk(str(path), num_shards=2)
    return path


def documents(path: Path, **more) -> DataConfig:
    return DataConfig(source="documents", paths=[str(path)], **more)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    return {fmt: write_corpus(root / fmt, fmt) for fmt in FORMATS}


def test_every_format_gives_the_same_stream_and_document_index(corpora):
    tok = ByteTokenizer()
    expected = torch.cat([tok.encode_tensor(d["text"], eos=True) for d in DOCS])
    lengths = torch.tensor([len(d["text"].encode()) + 1 for d in DOCS])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    hashes = set()
    for fmt, path in corpora.items():
        stream = load_stream(documents(path), vocab_size=320, seed=0)
        assert torch.equal(stream.read(0, len(stream)), expected), fmt
        assert torch.equal(stream.document_starts, starts), fmt
        assert stream.fingerprint["source"] == "documents" and stream.fingerprint["documents"] == len(DOCS)
        hashes.add(stream.fingerprint["sha256"])
    assert len(hashes) == 1  # cut into different shards (row groups, Arrow files), the same data to a run


def test_records_say_where_they_came_from(corpora):
    where = {fmt: [r.where for r in iter_records([str(p)], ["text"])][3] for fmt, p in corpora.items()}
    assert where["jsonl"] == f"{corpora['jsonl']}:4"
    assert where["csv"].startswith(f"{corpora['csv']}:")  # the line the record starts on (cells span lines)
    # rows counted from 1 as lines are (a trial's first parquet record read "row 0", its jsonl twin ":1")
    assert where["parquet"] == f"{corpora['parquet']} row 4"
    assert where["save_to_disk"].endswith(".arrow row 4")


def test_a_second_load_is_served_from_the_prepared_cache(corpora, tmp_path, monkeypatch):
    first = load_stream(documents(corpora["jsonl"]), vocab_size=320, seed=0)
    import accelrun.data.documents as documents_module

    def refuse(*args, **kwargs):
        raise AssertionError("prepared again although the cache holds it")

    monkeypatch.setattr(documents_module, "prepare_records", refuse)
    again = load_stream(documents(corpora["jsonl"]), vocab_size=320, seed=0)
    assert torch.equal(first.read(0, len(first)), again.read(0, len(again)))


def test_formats_train_to_identical_losses(corpora, tiny, tmp_path):
    losses, data = {}, {}
    for fmt in FORMATS:
        runs = tmp_path / fmt
        r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(3, "checkpoint.enabled=false", "data.source=documents",
                                     f"data.paths=[{corpora[fmt]}]", f"report.runs_dir={runs}")])
        assert r.exit_code == 0, r.output
        (run_dir,) = list((runs / "llama-debug").iterdir())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[fmt] = [row["loss"] for row in rows if "loss" in row]
        data[fmt] = json.loads((run_dir / "report.json").read_text())["data"]
    assert len(losses["jsonl"]) == 3
    assert all(v == losses["jsonl"] for v in losses.values()), losses
    # each run trained on these documents (equal losses alone would not tell): the report's data
    # fingerprint is the documents' content hash, the same whichever file held them
    documents_hash = load_stream(documents(corpora["jsonl"]), vocab_size=320, seed=0).fingerprint["sha256"]
    assert data == {fmt: documents_hash for fmt in FORMATS}, data


def train_error(tiny, *overrides: str) -> str:
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(1, "checkpoint.enabled=false", *overrides)])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1, r.output
    return errors[0]


def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny):
    good = write_corpus(tmp_path / "good", "jsonl")
    # a missing field, caught before training by the check validate also runs, naming the fields there are
    line = train_error(tiny, "data.source=documents", f"data.paths=[{good}]", "data.text_field=body")
    assert "no field 'body' (fields: 'id', 'text')" in line and "data.text_field" in line
    # a value that is not text
    line = train_error(tiny, "data.source=documents", f"data.paths=[{good}]", "data.text_field=id")
    assert f"{good}:1: data.text_field 'id' is int 0, not text" in line
    # a malformed line: file and line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "cut off\n')
    line = train_error(tiny, "data.source=documents", f"data.paths=[{bad}]")
    assert f"{bad}:2: malformed JSON line" in line
    # of two bad records, the first: a number at line 2 before a missing field (or a cut line) at line 4,
    # in a JSON lines file and in a JSON array (the missing field had been said first)
    for later in ('{"body": "x"}', '{"text": "cut off'):
        two = tmp_path / "two.jsonl"
        two.write_text("\n".join(['{"text": "fine"}', '{"text": 5}', '{"text": "fine"}', later]) + "\n")
        line = train_error(tiny, "data.source=documents", f"data.paths=[{two}]")
        assert f"{two}:2: data.text_field 'text' is int 5, not text" in line, line
    array = tmp_path / "two.json"
    array.write_text(json.dumps([{"text": "fine"}, {"text": 5}, {"text": "fine"}, {"body": "x"}]))
    line = train_error(tiny, "data.source=documents", f"data.paths=[{array}]")
    assert "data.text_field 'text' is int 5, not text" in line and "two.json row 2" in line, line
    # an empty corpus
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    line = train_error(tiny, "data.source=documents", f"data.paths=[{empty}]")
    assert "the corpus is empty" in line
    # a source with no paths, and a mixture weight <= 0, before anything is read (validate)
    line = train_error(tiny, "data.source=documents")
    assert "data.source = documents" in line and "needs data.paths" in line
    for weight in ("0", "-0.5"):
        r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG),
                                     f"data.mix=[{{paths: [{good}], weight: 1}}, {{paths: [{good}], weight: {weight}}}]"])
        errors = [line for line in r.output.splitlines() if line.startswith("error")]
        assert r.exit_code == 2 and len(errors) == 1, r.output
        assert f"data.mix.1.weight = {float(weight)}" in errors[0] and "must be > 0" in errors[0], r.output


def test_a_parquet_corpus_on_a_plain_install_is_one_line_naming_the_extra(corpora, tiny, monkeypatch):
    """What a user with a parquet file and no pyarrow meets, through the command line: validate and train
    each stop before anything starts with one line naming the extra."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    data = ["data.source=documents", f"data.paths=[{corpora['parquet']}]"]
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), *data])
    errors = [line for line in r.output.splitlines() if line.startswith("error")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "corpus.parquet" in errors[0] and "pip install 'accelrun[data]'" in errors[0], r.output
    line = train_error(tiny, *data)
    assert "corpus.parquet" in line and "pip install 'accelrun[data]'" in line


def test_a_missing_field_deep_in_the_corpus_names_its_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n{"body": "c", "id": 3}\n')
    # the records before it have the field: this one is to be fixed, not data.text_field changed
    with pytest.raises(DataError, match=rf"^{path}:4: no field 'text' \(fields: 'body', 'id'\); records before "
                                        r"it in this file have it: fix or remove this one$"):  # fmt: skip
        load_stream(documents(path), vocab_size=320, seed=0)


def test_parquet_without_pyarrow_names_the_extra(corpora, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(DataError, match=r"corpus.parquet: reading .parquet files needs pyarrow: "
                                        r"pip install 'accelrun\[data\]'"):
        list(iter_records([str(corpora["parquet"])], ["text"]))
    # jsonl, json and csv need only the standard library
    assert len(list(iter_records([str(corpora[f]) for f in ("jsonl", "json", "csv")], ["text"]))) == 3 * len(DOCS)

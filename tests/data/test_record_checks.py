"""Bad record files say what is wrong once, where, and what to do; ``validate`` reads the first record of
each file (as train's preflight does) and says that the others are checked when training reads them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config.schema import DataConfig
from accelrun.data import DataError, load_stream
from tests.conftest import DEFAULT_CONFIG


def validate(*paths: Path, more: tuple[str, ...] = ()):
    listed = ", ".join(str(p) for p in paths)
    return CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), "data.source=documents",
                                    f"data.paths=[{listed}]", *more])


def one_error(r) -> str:
    errors = [line for line in r.output.splitlines() if line.startswith("error")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    return errors[0]


def test_a_raw_tab_in_a_json_line_is_named_once_with_the_fix(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "a\tb"}\n')
    with pytest.raises(DataError) as e:
        load_stream(DataConfig(source="documents", paths=[str(path)]), vocab_size=320, seed=0)
    assert str(e.value) == (f"{path}:2: malformed JSON line: invalid control character at column 12 "
                            "(a tab or newline inside a string is written \\t or \\n)")


def test_validate_catches_a_malformed_first_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a",}\n')
    line = one_error(validate(path))
    assert f"{path}:1: malformed JSON line: expecting property name" in line and " at at " not in line
    assert 'each line is one JSON object, e.g. {"text": "..."}' in line


def test_a_line_cut_short_names_its_own_column(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "oops", \n')
    with pytest.raises(DataError) as e:
        load_stream(DataConfig(source="documents", paths=[str(path)]), vocab_size=320, seed=0)
    assert str(e.value).startswith(f"{path}:2: malformed JSON line: expecting property name enclosed in double "
                                   "quotes at column 18")
    first = tmp_path / "d.jsonl"
    first.write_text('{"text": "oops", \n')
    assert f"{first}:1: malformed JSON line: expecting property name enclosed in double quotes at column 18" \
        in one_error(validate(first))


def test_validate_catches_a_first_record_that_is_not_text(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": 5}\n')
    line = one_error(validate(path))
    assert f"{path}:1: data.text_field 'text' is int 5, not text; set data.text_field" in line


def test_an_empty_corpus_names_its_files_in_validate_and_in_data_prepare(tmp_path):
    empty, header_only = tmp_path / "empty.jsonl", tmp_path / "header.csv"
    empty.write_text("\n")
    header_only.write_text("id,text\n")
    line = one_error(validate(empty, header_only))
    assert f"the corpus is empty: no records in {empty}, {header_only}" in line
    r = CliRunner().invoke(cli, ["data", "prepare", str(empty), "-o", str(tmp_path / "out")])
    assert f"the corpus is empty: no record of {empty} has text" in one_error(r)


def test_validate_says_which_records_it_read(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b\tc"}\n')  # line 2 is train's to find
    r = validate(path)
    assert r.exit_code == 0, r.output
    assert "records: the first of each file checked (its fields, text, JSON); the others are checked when " \
           "training reads them" in " ".join(r.output.split())


def test_a_folder_s_files_that_are_not_records_are_named_not_skipped_quietly(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.jsonl").write_text('{"text": "hello"}\n')
    (corpus / "README.md").write_text("notes\n")
    (corpus / "sub" / "b.txt").write_text("more\n")
    (corpus / ".hidden").write_text("x\n")
    r = validate(corpus)
    assert r.exit_code == 0, r.output
    warnings = [" ".join(w.split()) for w in r.output.split("warning:")[1:]]
    assert len(warnings) == 1 and f"data.paths: skipping 2 files in the folders or globs given that are not a record file " \
        f"(.jsonl, .ndjson, .json, .csv, .parquet, .arrow): {corpus / 'README.md'}, {corpus / 'sub' / 'b.txt'}" \
        in warnings[0], r.output
    r = CliRunner().invoke(cli, ["data", "prepare", str(corpus), "-o", str(tmp_path / "out")])
    assert r.exit_code == 0 and "warning: skipping 2 files in the folders or globs given" in r.output, r.output
    # A glob's matches alike (a trial's `data.paths=[mixed/*]` left its .txt file out without a word)
    r = validate(f"{corpus}/*.*")
    assert r.exit_code == 0 and f"skipping 1 file in the folders or globs given that is not a record file " \
        f"(.jsonl, .ndjson, .json, .csv, .parquet, .arrow): {corpus / 'README.md'}" in " ".join(r.output.split()), r.output
    (corpus / "README.md").unlink()
    (corpus / "sub" / "b.txt").unlink()
    r = validate(corpus)
    assert r.exit_code == 0 and "warning" not in r.output, r.output


def test_validate_reads_each_mixed_sources_first_records_and_names_its_key(tmp_path):
    good, other = tmp_path / "c.jsonl", tmp_path / "d.jsonl"
    good.write_text('{"text": "a"}\n')
    other.write_text('{"body": "a"}\n')
    mix = f"data.mix=[{{paths: [{good}], weight: 1}}, {{paths: [{other}], weight: 1}}]"
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), mix])
    line = one_error(r)
    assert f"{other}: no field 'text' (fields: 'body'); set data.mix.1.text_field (now 'text', default)" in line
    fixed = f"data.mix=[{{paths: [{good}], weight: 1}}, {{paths: [{other}], weight: 1, text_field: body}}]"
    r = CliRunner().invoke(cli, ["validate", str(DEFAULT_CONFIG), fixed])
    assert r.exit_code == 0, r.output
    assert "records: the first of each file checked" in " ".join(r.output.split())


def test_chat_records_read_as_documents_point_at_the_chat_format(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    line = one_error(validate(path))
    assert line.endswith(f"{path}: no field 'text' (fields: 'messages'); these are chat records: data.format=chat "
                         "reads them"), line


def test_a_byte_order_mark_is_not_part_of_the_first_field_or_line(tmp_path):
    """A trial's Excel "CSV UTF-8" file read as a field named '\\ufefftext' (exit 2), and a jsonl with a BOM
    stopped on "unexpected UTF-8 BOM (decode using utf-8-sig)"."""
    from accelrun.data.records import iter_records

    (tmp_path / "excel.csv").write_bytes("\ufefftext,id\nhello,1\nworld,2\n".encode())
    (tmp_path / "bom.jsonl").write_bytes('\ufeff{"text": "hello"}\r\n{"text": "world"}\r\n'.encode())
    (tmp_path / "bom.json").write_bytes('\ufeff[{"text": "hello"}, {"text": "world"}]'.encode())
    for name in ("excel.csv", "bom.jsonl", "bom.json"):
        r = validate(tmp_path / name)
        assert r.exit_code == 0, r.output
        assert [rec["text"] for rec in iter_records([str(tmp_path / name)], ["text"])] == ["hello", "world"], name


def test_a_parquet_column_nested_in_a_struct_is_not_taken_for_a_top_level_one(tmp_path):
    """validate read the parquet schema's leaves (a struct's doc.text as 'text'): "valid", then train and
    data prepare crashed with KeyError: 'Field "text" does not exist in schema' (a trial's)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"doc": [{"text": "hello"}, {"text": "world"}]}), tmp_path / "nested.parquet")
    r = validate(tmp_path / "nested.parquet")
    assert r.exit_code == 2 and "no field 'text' (fields: 'doc')" in " ".join(r.output.split()), r.output


def test_chat_records_read_as_text_records_say_what_they_look_like(tmp_path):
    """A trial's `accelrun data prepare chats.jsonl` said only "no field 'text' (fields: 'messages')"."""
    from accelrun.data.records import iter_records
    from accelrun.errors import DataError

    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DataError, match="its 'messages' look like chat records: train reads them with data.format=chat"):
        list(iter_records([str(tmp_path / "chats.jsonl")], ["text"], column_key="data.text_field"))


def test_a_csv_separated_by_semicolons_says_so(tmp_path):
    """A trial's ;-separated .csv said only "no field 'text' (fields: 'id;text')", in validate and in train."""
    from accelrun.data.records import iter_records
    from accelrun.errors import DataError

    (tmp_path / "semi.csv").write_text("id;text\n1;hello\n")
    hint = "its one field holds ';': a file separated by ';' is read as one column (.csv is read comma-separated)"
    r = validate(tmp_path / "semi.csv")
    assert r.exit_code == 2 and hint in " ".join(r.output.split()), r.output
    with pytest.raises(DataError, match=re.escape(hint)):
        list(iter_records([str(tmp_path / "semi.csv")], ["text"]))

"""Records from the files teams keep corpora in: ``.jsonl``, ``.json``, ``.csv``, ``.parquet``, ``.arrow``
and ``datasets`` ``save_to_disk`` folders, the format from the extension.

Public entry point (the ``documents`` source, chat data and ``accelrun data prepare`` read through it)::

    iter_records(paths, columns, *, key="data.paths") -> Iterator[Record]
    record[column] -> the value;  record.where -> "corpus/a.jsonl:17" / "corpus/b.parquet row 1203"

    for record in iter_records(["corpus/*.jsonl"], ["text"]):
        text = record.text("text", key="data.text_field")   # a str, or one DataError line naming record.where

``iter_record_batches`` gives the same records a batch at a time (columns as lists), for encoders
that work on batches. Everything is streamed: jsonl, json lines and csv a line at a time with the
standard library (no extra needed), parquet a row group's batch at a time and Arrow files through a
memory map (pyarrow, ``pip install 'accelrun[data]'``), so memory stays bounded on a corpus larger
than RAM. A ``.json`` file holding one JSON array is the exception: it is parsed whole.

Errors are ``DataError``s of one line that name the file and line (or row): a malformed jsonl line, a
missing column (with the columns that exist), an empty corpus.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelrun.config.record_paths import (  # noqa: F401 (part of this module's interface)
    EXTENSIONS,
    JSON_LINE_EXPECTED,
    PYARROW_HINT,
    RecordFile,
    RecordFormat,
    file_names,
    json_problem,
    other_separator,
    pyarrow_module,
    record_files,
)
from accelrun.errors import DataError

ROWS_PER_BATCH = 1024


class LinesBefore:
    """How many lines precede byte ``offset`` of ``path``: counted only when a message needs a line
    number, so a worker reading a byte range of a large jsonl file never reads what precedes it."""

    def __init__(self, path: Path | None = None, offset: int = 0):
        self.path, self.offset = path, offset
        self._count: int | None = 0 if offset == 0 else None

    @property
    def count(self) -> int:
        if self._count is None:
            n, left = 0, self.offset
            with open(self.path, "rb") as fh:
                while left:
                    chunk = fh.read(min(left, 16 << 20))
                    if not chunk:
                        break
                    n, left = n + chunk.count(b"\n"), left - len(chunk)
            self._count = n
        return self._count


NO_LINES_BEFORE = LinesBefore()


@dataclass(frozen=True)
class RecordBatch:
    """Consecutive records of one file: ``columns[name][i]`` is record ``i``'s value."""

    file: RecordFile
    columns: dict[str, list[Any]]
    lines: list[int] | None  # jsonl / csv: each record's line (1-based); None: columnar, rows count
    first_row: int  # the index (from 0) of record 0 within its file; ``where`` says rows from 1
    lines_before: LinesBefore = NO_LINES_BEFORE  # lines are counted from a byte offset of the file

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def where(self, i: int) -> str:
        if self.lines is not None:
            return f"{self.file.path}:{self.lines_before.count + self.lines[i]}"
        return f"{self.file.path} row {self.first_row + i + 1}"  # counted from 1, as a jsonl file's lines are

    def text(self, column: str, i: int, *, key: str) -> str:
        """Record ``i``'s ``column`` if it is a string; else one line naming where and what it is."""
        value = self.columns[column][i]
        if isinstance(value, str):
            return value
        raise _not_text(self.where(i), key, column, value)

    def record(self, i: int) -> Record:
        return Record({c: v[i] for c, v in self.columns.items()}, self.where(i))


@dataclass(frozen=True)
class Record:
    """One record's requested columns and where it came from."""

    values: dict[str, Any]
    where: str

    def __getitem__(self, column: str) -> Any:
        return self.values[column]

    def text(self, column: str, *, key: str) -> str:
        value = self.values[column]
        if isinstance(value, str):
            return value
        raise _not_text(self.where, key, column, value)


def _not_text(where: str, key: str, column: str, value: Any) -> DataError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    what = "null" if value is None else f"{type(value).__name__} {shown}"
    return DataError(f"{where}: {key} {column!r} is {what}, not text")


def iter_records(paths: Sequence[str], columns: Sequence[str], *, key: str = "data.paths",
                 column_key: str | None = None) -> Iterator[Record]:
    """Every record of the files ``paths`` names (files, folders, globs), in order, with ``columns``.

    A record without one of ``columns`` is a ``DataError`` naming the columns it has (``column_key``,
    e.g. ``data.text_field``, is the setting the message tells the user to change)."""
    for batch in iter_record_batches(paths, columns, key=key, column_key=column_key):
        for i in range(len(batch)):
            yield batch.record(i)


def iter_record_batches(paths: Sequence[str], columns: Sequence[str], *, key: str = "data.paths",
                        column_key: str | None = None, rows: int = ROWS_PER_BATCH) -> Iterator[RecordBatch]:
    """``iter_records``, a batch of up to ``rows`` records of one file at a time. An empty corpus
    (no record in any file) is a ``DataError`` once everything was read."""
    files = record_files(paths, key=key)
    seen = 0
    for f in files:
        for batch in read_file(f, columns, column_key=column_key, rows=rows):
            seen += len(batch)
            yield batch
    if seen == 0:
        raise DataError(f"{key}: the corpus is empty: no records in {file_names(files)}")


def read_file(f: RecordFile, columns: Sequence[str], *, column_key: str | None = None,
              rows: int = ROWS_PER_BATCH) -> Iterator[RecordBatch]:
    """The records of one file, ``rows`` at a time."""
    readers = {RecordFormat.JSONL: _read_json_lines, RecordFormat.JSON: _read_json, RecordFormat.CSV: _read_csv,
               RecordFormat.PARQUET: _read_parquet, RecordFormat.ARROW: _read_arrow}
    try:
        yield from readers[f.format](f, list(columns), column_key, rows)
    except OSError as e:
        raise DataError(f"cannot read {str(f.path)!r}: {e.strerror or e}") from None


def _missing(where: str, column: str, have: Sequence[str], column_key: str | None,
             records_before: int = 0) -> DataError:
    """``records_before``: records of this file read before this one (by this reader), each of which had
    the field: one stray record is to be fixed or left out, not the recipe's field changed."""
    if records_before:
        fix = "; records before it in this file have it: fix or remove this one"
    else:
        fix = f"; set {column_key} to one of them" if column_key and have else ""
    fields = ", ".join(repr(h) for h in have) if have else "none"
    if "messages" in have and column != "messages":  # (a trial's `data prepare chats.jsonl` said only this)
        fix += ("; its 'messages' look like chat records: train reads them with data.format=chat (and "
                "`accelrun data prepare` prepares text records only)")
    fix += other_separator(have)
    return DataError(f"{where}: no field {column!r} (fields: {fields}){fix}")


class _Rows:
    """Collects dict records of a line-oriented file into batches, checking each has the columns."""

    def __init__(self, f: RecordFile, columns: list[str], column_key: str | None,
                 lines_before: LinesBefore = NO_LINES_BEFORE):
        self.f, self.columns, self.column_key, self.lines_before = f, columns, column_key, lines_before
        self.values: dict[str, list[Any]] = {c: [] for c in columns}
        self.lines: list[int] = []
        self.first_row = self.n = 0

    def where(self, line: int) -> str:
        return f"{self.f.path}:{self.lines_before.count + line}"

    def add(self, obj: Any, line: int) -> None:
        if not isinstance(obj, dict):
            raise DataError(f"{self.where(line)}: expected a JSON object per record, got {type(obj).__name__}")
        for c in self.columns:
            if c not in obj:
                raise _missing(self.where(line), c, list(obj), self.column_key, records_before=self.n)
            self.values[c].append(obj[c])
        self.lines.append(line)
        self.n += 1

    def take(self) -> RecordBatch:
        batch = RecordBatch(self.f, self.values, self.lines, self.first_row, self.lines_before)
        self.first_row = self.n
        self.values, self.lines = {c: [] for c in self.columns}, []
        return batch


def _read_json_lines(f: RecordFile, columns, column_key, rows, byte_range: tuple[int, int] | None = None):
    """JSON lines; with ``byte_range = (start, stop)``, only the lines that begin in it (a line that
    straddles ``start`` belongs to the range before), so ranges split a file without overlap."""
    start, stop = byte_range if byte_range is not None else (0, None)
    rec = _Rows(f, columns, column_key, LinesBefore(f.path, start))
    with open(f.path, "rb") as fh:
        number = 0  # lines read since ``start``: the partial line skipped below counts
        if start > 0:
            fh.seek(start - 1)
            if fh.read(1) != b"\n":
                fh.readline()  # the rest of a line that began before the range
                number = 1
        while stop is None or fh.tell() < stop:
            line = fh.readline()
            if not line:
                break
            number += 1
            if not line.strip():
                continue
            try:
                try:
                    # Without its newline: a line cut short reports its own column, not "column 1" of the next.
                    # ("utf-8-sig": a byte-order mark that an editor put before the first line is not JSON's)
                    obj = json.loads(line.decode("utf-8-sig" if number == 1 and start == 0 else "utf-8",
                                                 errors="replace").rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    raise DataError(f"{rec.where(number)}: malformed JSON line: "
                                    f"{json_problem(e, expected=JSON_LINE_EXPECTED)}") from None
                rec.add(obj, number)
            except DataError:
                if rec.lines:  # the records before it first: a problem of theirs is the file's first
                    yield rec.take()
                raise
            if len(rec.lines) >= rows:
                yield rec.take()
    if rec.lines:
        yield rec.take()


def _read_json(f: RecordFile, columns, column_key, rows):
    """A ``.json`` file: one JSON array of objects (parsed whole), or JSON lines as datasets writes them."""
    with open(f.path, encoding="utf-8-sig", errors="replace") as fh:
        head = fh.read(4096).lstrip()
    if not head.startswith("["):
        yield from _read_json_lines(f, columns, column_key, rows)
        return
    try:
        items = json.loads(Path(f.path).read_text(encoding="utf-8-sig", errors="replace"))
    except json.JSONDecodeError as e:
        raise DataError(f"{f.path}:{e.lineno}: malformed JSON: "
                        f"{json_problem(e, expected='a .json file is one array of objects, or one object per line')}") from None
    rec = _Rows(f, columns, column_key)
    for i, obj in enumerate(items):
        problem = (DataError(f"{f.path} row {i + 1}: expected a JSON object per record, got {type(obj).__name__}")
                   if not isinstance(obj, dict) else
                   next((_missing(f"{f.path} row {i + 1}", c, list(obj), column_key, records_before=i)
                         for c in columns if c not in obj), None))
        if problem is not None:
            if rec.lines:  # the records before it first: a problem of theirs is the file's first
                yield _as_rows(rec.take())
            raise problem
        rec.add(obj, i)
        if len(rec.lines) >= rows:
            yield _as_rows(rec.take())
    if rec.lines:
        yield _as_rows(rec.take())


def _as_rows(batch: RecordBatch) -> RecordBatch:
    """A JSON array's records are counted as items, not lines."""
    return RecordBatch(batch.file, batch.columns, None, batch.first_row)


def _read_csv(f: RecordFile, columns, column_key, rows):
    csv.field_size_limit(2**31 - 1)  # a document is one cell: the default 128 KiB cap is too small
    rec = _Rows(f, columns, column_key)
    with open(f.path, encoding="utf-8-sig", errors="replace", newline="") as fh:  # (Excel's "CSV UTF-8": a BOM)
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        for c in columns:
            if c not in header:
                raise _missing(f"{f.path}:1", c, header, column_key)
        line = reader.line_num + 1
        for row in reader:
            rec.add(row, line)
            line = reader.line_num + 1  # a quoted cell may span several lines
            if len(rec.lines) >= rows:
                yield rec.take()
    if rec.lines:
        yield rec.take()


def _check_schema(f: RecordFile, names: Sequence[str], columns, column_key) -> None:
    for c in columns:
        if c not in names:
            raise _missing(str(f.path), c, list(names), column_key)


def _columnar(f: RecordFile, batches, columns, first_row: int = 0):
    for b in batches:
        if b.num_rows:
            yield RecordBatch(f, {c: b.column(c).to_pylist() for c in columns}, None, first_row)
            first_row += b.num_rows


def _read_parquet(f: RecordFile, columns, column_key, rows):
    pa = pyarrow_module(f)
    try:
        pf = pa.parquet.ParquetFile(f.path)
    except pa.ArrowInvalid as e:
        raise DataError(f"{f.path}: not a parquet file ({e})") from None
    _check_schema(f, pf.schema_arrow.names, columns, column_key)
    yield from _columnar(f, pf.iter_batches(batch_size=rows, columns=columns), columns)


def _read_arrow(f: RecordFile, columns, column_key, rows):
    """An Arrow IPC stream (what ``save_to_disk`` writes) or IPC file, memory-mapped: batches are read
    in place, so only the columns asked for are touched."""
    pa = pyarrow_module(f)
    with pa.memory_map(str(f.path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
            schema = reader.schema
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                file_reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise DataError(f"{f.path}: not an Arrow IPC stream or file ({e})") from None
            schema = file_reader.schema
            batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
        _check_schema(f, schema.names, columns, column_key)
        selected = (b.select(columns) for b in batches)
        sliced = (b.slice(s, rows) for b in selected for s in range(0, b.num_rows, rows))
        yield from _columnar(f, sliced, columns)

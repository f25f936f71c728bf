"""Which record files ``data.paths`` names for the ``documents`` source, and the fields their records
have (no torch): ``accelrun validate`` checks them before anything is built, and
``accelrun.data.records`` reads them.

Formats come from the extension: ``.jsonl`` / ``.ndjson``, ``.json``, ``.csv``, ``.parquet``, ``.arrow``;
a folder written by ``datasets``' ``save_to_disk`` (it holds ``state.json``) stands for its Arrow files.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from accelrun.config.data_paths import did_you_mean, where_relative
from accelrun.errors import DataError

PYARROW_HINT = "pip install 'accelrun[data]' (pyarrow)"


class RecordFormat(Enum):
    JSONL = "jsonl"
    JSON = "json"
    CSV = "csv"
    PARQUET = "parquet"
    ARROW = "arrow"

    @property
    def needs_pyarrow(self) -> bool:
        return self in (RecordFormat.PARQUET, RecordFormat.ARROW)


EXTENSIONS = {".jsonl": RecordFormat.JSONL, ".ndjson": RecordFormat.JSONL, ".json": RecordFormat.JSON,
              ".csv": RecordFormat.CSV, ".parquet": RecordFormat.PARQUET, ".arrow": RecordFormat.ARROW}


@dataclass(frozen=True)
class RecordFile:
    path: Path
    format: RecordFormat


def record_files(paths: Sequence[str], *, key: str = "data.paths",
                 skipped: list[Path] | None = None) -> list[RecordFile]:
    """The record files ``paths`` names, in order: a file by its extension, a ``save_to_disk`` folder as
    its Arrow files, any other folder as the record files under it (sorted), a glob as its matches.
    ``skipped``, when given, collects the folders' other files (``skipped_note`` names them)."""
    if not paths:
        raise DataError(f"{key} is empty: give at least one file, folder or glob")
    out: list[RecordFile] = []
    seen: set[str] = set()
    for pattern in paths:
        expanded = os.path.expanduser(pattern)
        matches = path_matches(pattern)
        if not matches:
            raise DataError(f"{key}: {pattern!r} matches no file or folder"
                            f"{did_you_mean(pattern)}{where_relative(pattern)}")
        found: list[RecordFile] = []
        for m in matches:
            found += (_folder_files(Path(m), key, skipped) if os.path.isdir(m)
                      else _one_file(Path(m), key, strict=m == expanded, skipped=skipped))
        if not found:
            # (text files matched one by one: the text source reads files and globs, not folders)
            texts = any(Path(m).suffix.lower() == ".txt" and os.path.isfile(m) for m in matches)
            hint = "; its .txt files are plain text, which data.source=text reads (a file a document)" if texts else ""
            raise DataError(f"{key}: {pattern!r} holds no record files ({', '.join(EXTENSIONS)}){hint}")
        for f in found:
            if (a := os.path.abspath(f.path)) not in seen:
                seen.add(a)
                out.append(f)
    return out


def path_matches(pattern: str) -> list[str]:
    """What a data path names: a glob's matches (``**`` across folders), or the path itself if it exists."""
    expanded = os.path.expanduser(pattern)
    if glob.has_magic(expanded):
        return sorted(glob.glob(expanded, recursive=True))
    return [expanded] if os.path.exists(expanded) else []


def _one_file(path: Path, key: str, *, strict: bool, skipped: list[Path] | None = None) -> list[RecordFile]:
    fmt = EXTENSIONS.get(path.suffix.lower())
    if fmt is None:
        if strict:  # named on its own: say what is read
            raise DataError(f"{key}: {str(path)!r} is not a record file: expected one of {', '.join(EXTENSIONS)} "
                            "or a save_to_disk folder (plain text files: data.source = text)")
        if skipped is not None and not path.name.startswith("."):  # a glob's other matches: named, as a folder's
            skipped.append(path)
        return []
    return [RecordFile(path, fmt)]


def _folder_files(folder: Path, key: str, skipped: list[Path] | None = None) -> list[RecordFile]:
    """The record files under ``folder``; the others (hidden ones aside) go to ``skipped`` when given."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        first = splits[0] if splits else "train"
        raise DataError(f"{key}: {str(folder)!r} is a DatasetDict with splits {', '.join(splits)}: name one "
                        f"split's folder, e.g. {str(folder / first)!r}")
    if (folder / "state.json").is_file():  # datasets' save_to_disk: its Arrow files, in their order
        try:
            state = json.loads((folder / "state.json").read_text())
            names = [d["filename"] for d in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{key}: {folder / 'state.json'} is not a save_to_disk state file ({e})") from None
        return [RecordFile(folder / n, RecordFormat.ARROW) for n in names]
    out: list[RecordFile] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        here = Path(dirpath)
        if here != folder and (here / "state.json").is_file():  # a save_to_disk folder inside
            out += _folder_files(here, key)
            dirnames[:] = []
            continue
        for n in sorted(filenames):
            if n.startswith("."):
                continue
            if (fmt := EXTENSIONS.get(Path(n).suffix.lower())) is not None:
                out.append(RecordFile(here / n, fmt))
            elif skipped is not None:
                skipped.append(here / n)
    return out


def skipped_in_folders(paths: Sequence[str]) -> list[Path]:
    """The files under the folders ``paths`` names that ``record_files`` passes over (not a record
    extension), for a command that reads the records later; a ``save_to_disk`` folder's other files are
    its metadata and are not counted. A pattern ``record_files`` refuses is its to report: none here."""
    skipped: list[Path] = []
    try:
        record_files(paths, skipped=skipped)
    except DataError:
        pass
    return skipped


def skipped_note(skipped: Sequence[Path]) -> str | None:
    """One line naming the files a folder walk passed over, or None when there were none."""
    if not skipped:
        return None
    many = len(skipped) > 1
    return (f"skipping {len(skipped)} file{'s' if many else ''} in the folders or globs given that {'are' if many else 'is'} "
            f"not a record file ({', '.join(EXTENSIONS)}): {path_names(skipped)}")


def file_names(files: Sequence[RecordFile]) -> str:
    """The first few files of a corpus, for a message about all of them."""
    return path_names([f.path for f in files])


def path_names(paths: Sequence[Path]) -> str:
    """The first few of ``paths``, and how many there are when there are more."""
    return ", ".join(str(p) for p in paths[:3]) + (f", ... ({len(paths)} files)" if len(paths) > 3 else "")


def empty_corpus(files: Sequence[Path]) -> str:
    """Files that hold no bytes between them: a stream of no tokens, nothing to train on."""
    return f"the corpus is empty: {path_names(files)} {'has' if len(files) == 1 else 'have'} no bytes of text"


def pyarrow_module(f: RecordFile):
    """pyarrow (with its ipc and parquet modules), or one line naming the extra that installs it."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{f.path}: reading .{f.format.value} files needs pyarrow: {PYARROW_HINT}") from None
    return pyarrow



JSON_LINE_EXPECTED = 'each line is one JSON object, e.g. {"text": "..."}'
PEEK_BYTES = 1 << 16


def json_problem(e: json.JSONDecodeError, *, expected: str) -> str:
    """What the json module found and where, said once (some of its messages already end in "at":
    "Invalid control character at"), and the likely fix: a raw tab or newline inside a string for that
    one, else what a record should look like (``expected``)."""
    what = e.msg.removesuffix(" at")
    hint = "a tab or newline inside a string is written \\t or \\n" if "control character" in what else expected
    return f"{what[:1].lower()}{what[1:]} at column {e.colno} ({hint})"


@dataclass(frozen=True)
class RecordPeek:
    """The start of a record file, read cheaply before training (the readers check every record later)."""

    fields: list[str]  # the first record's fields, the csv header or the schema; empty when not known
    first: dict | None = None  # the first record itself (JSON lines); None when not read
    where: str = ""  # file:line of ``first``
    empty: bool = False  # certainly no record in the file


def record_fields(f: RecordFile) -> list[str]:
    """The fields of ``f``'s first record (jsonl, json lines), its header (csv) or its schema (parquet,
    Arrow): enough to check a field name before training. Empty for a file with no record."""
    return peek_records(f).fields


def peek_records(f: RecordFile) -> RecordPeek:
    """``f``'s fields and, where it costs one read of its first 64 KiB, its first record; a first JSON
    line that is complete but malformed is the ``DataError`` a run would stop on (file:line)."""
    if f.format.needs_pyarrow:
        pa = pyarrow_module(f)
        try:
            if f.format is RecordFormat.PARQUET:
                meta = pa.parquet.read_metadata(f.path)
                # the top-level columns, as training reads them (the parquet schema's names are its leaves:
                # a struct's `doc.text` passed validate as `text`, and train crashed on a KeyError)
                return RecordPeek(list(meta.schema.to_arrow_schema().names), empty=meta.num_rows == 0)
            with pa.memory_map(str(f.path)) as source:
                try:
                    return RecordPeek(list(pa.ipc.open_stream(source).schema.names))
                except pa.ArrowInvalid:
                    source.seek(0)
                    return RecordPeek(list(pa.ipc.open_file(source).schema.names))
        except pa.ArrowInvalid as e:
            raise DataError(f"{f.path}: not a .{f.format.value} file pyarrow reads ({e})") from None
    with open(f.path, encoding="utf-8-sig", errors="replace", newline="") as fh:  # (a BOM is no field's name)
        if f.format is RecordFormat.CSV:
            rows = csv.reader(fh)  # every csv value is text: the header and whether a row follows suffice
            header, first = next(rows, []), next(rows, None)
            return RecordPeek(header, empty=first is None)
        head = fh.read(PEEK_BYTES)
        whole = len(head) < PEEK_BYTES
    if not head.strip():
        return RecordPeek([], empty=whole)
    if head.lstrip().startswith("["):  # a JSON array: the reader parses it whole
        return RecordPeek([])
    lines = head.splitlines(keepends=True)
    number = next(i for i, line in enumerate(lines) if line.strip())
    line = lines[number]
    if not (whole or line.endswith("\n")):  # cut by the peek: the reader sees all of it
        return RecordPeek([])
    try:
        obj = json.loads(line.rstrip("\r\n"))  # a line cut short: its column, not "column 1" of the next
    except json.JSONDecodeError as e:
        raise DataError(f"{f.path}:{number + 1}: malformed JSON line: "
                        f"{json_problem(e, expected=JSON_LINE_EXPECTED)}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{f.path}:{number + 1}: expected a JSON object per record, got {type(obj).__name__}")
    return RecordPeek(list(obj), obj, f"{f.path}:{number + 1}")


def other_separator(fields: Sequence[str]) -> str:
    """``; its one field holds ';' ...`` where a file's header read as one field holding another separator
    than the comma (a trial's ;-separated .csv said only "fields: 'id;text'"), else ""."""
    sep = next((s for s in (";", "\t", "|") if len(fields) == 1 and s in fields[0]), None)
    if sep is None:
        return ""
    return (f"; its one field holds {sep!r}: a file separated by {sep!r} is read as one column (.csv is read "
            "comma-separated): save it with commas, or as .jsonl")

"""``accelrun data prepare``: tokenize a corpus once into memory-mappable token files (text files into one
file, record files into a folder of shards with document indexes)."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from accelrun.cli.common import err, out
from accelrun.errors import UserError


@click.group("data")
def command() -> None:
    """Prepare training data, or write the README's example inputs.

    \b
    Examples:
      accelrun data examples
      accelrun data prepare 'corpus/**/*.txt' -o data/corpus.tok
      accelrun data prepare 'corpus/*.parquet' -o data/corpus --workers 4
    """


@command.command("prepare")
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Token file to write (text files), or folder of shards (record files).")
@click.option("--max-bytes", type=click.IntRange(min=1), default=None,
              help="Text files: read at most this many bytes of text.")
@click.option("--tokenizer", default="byte", show_default=True,
              help="byte, or a tokenizer.json / a Hugging Face folder holding one (needs accelrun[hf]).")
@click.option("--text-field", default="text", show_default=True, help="Record files: the column holding the text.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Record files: processes encoding pieces of the corpus at once (the shards are the same).")
def prepare(inputs: tuple[str, ...], output: Path, max_bytes: int | None, tokenizer: str, text_field: str,
            workers: int) -> None:
    """Tokenize a corpus once, for `data.source: tokens`.

    Text files (one document each) become one token file. Record files (.jsonl .json .csv .parquet
    .arrow, save_to_disk folders; the format from the extension) become a folder of memory-mapped
    shards with document indexes, written under a temporary name and renamed when complete.
    Either records its tokenizer; a run reading it needs the same data.tokenizer.

    \b
    Examples:
      accelrun data prepare 'corpus/**/*.txt' -o data/corpus.tok
      accelrun train configs/llama.yaml data.source=tokens 'data.paths=[data/corpus.tok]'
      accelrun data prepare 'corpus/*.parquet' -o data/corpus --workers 4
      accelrun train configs/llama.yaml data.source=tokens 'data.paths=[data/corpus]'
      accelrun data prepare 'corpus/**/*.txt' -o data/corpus-bpe.tok --tokenizer models/my-tokenizer
    """
    if is_record_input(inputs):
        if max_bytes is not None:
            raise UserError("--max-bytes reads a prefix of text files; record files are read whole (leave it out)")
        _prepare_records(inputs, output, tokenizer, text_field, workers)
        return
    if workers > 1 or text_field != "text":
        raise UserError("--workers and --text-field are for record files (.jsonl .json .csv .parquet .arrow, "
                        "save_to_disk folders); text files are prepared by one process")
    if output.is_dir():
        raise UserError(f"-o: {str(output)!r} is a directory: text files prepare into one token file, e.g. "
                        f"{str(output / 'corpus.tok')!r}")
    from accelrun.data import prepare_tokens

    with Progress(*Progress.get_default_columns()[:1], BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("tokenizing", total=None)

        def on_progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        info = prepare_tokens(list(inputs), str(output), tokenizer=tokenizer, max_bytes=max_bytes,
                              progress=on_progress, tokenizer_key="--tokenizer")
    _print_summary(info)


def is_record_input(inputs: tuple[str, ...]) -> bool:
    """Record files or folders (by extension, or a folder), not text files."""
    from accelrun.config.record_paths import EXTENSIONS

    return any(Path(p).suffix.lower() in EXTENSIONS or Path(p).is_dir() for p in inputs)


def _prepare_records(inputs: tuple[str, ...], output: Path, tokenizer: str, text_field: str, workers: int) -> None:
    from accelrun.config.record_paths import skipped_in_folders, skipped_note
    from accelrun.data.prepare_records import prepare_records

    if note := skipped_note(skipped_in_folders(inputs)):
        err.print(f"[bold yellow]warning:[/] {escape(note)}", highlight=False)
    started = time.perf_counter()
    with Progress(*Progress.get_default_columns()[:1], BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TextColumn("{task.fields[tokens_rate]}"), TimeRemainingColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as bar:
        task = bar.add_task("tokenizing", total=None, tokens_rate="")

        def on_progress(done: int, total: int, tokens: int) -> None:
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            bar.update(task, completed=done, total=total, tokens_rate=f"{rate:,.0f} tokens/s")

        info = prepare_records(list(inputs), output, tokenizer=tokenizer, text_field=text_field, workers=workers,
                               progress=on_progress)
    seconds = time.perf_counter() - started
    summary = asdict(info)
    summary["throughput"] = (f"{info.bytes / seconds / 2**20:,.1f} MB/s, {info.tokens / seconds:,.0f} tokens/s "
                             f"({workers} worker{'s' if workers > 1 else ''})")
    _print_summary(summary)


def _print_summary(info: dict) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    labels = {"path": "written", "files": "input files", "bytes": "input bytes", "tokens": "tokens",
              "token_bytes": "bytes stored per token id", "tokenizer": "tokenizer", "vocab_size": "vocabulary",
              "sha256": "sha256 of the tokens", "tokenizer_file": "tokenizer file",
              "between_documents": "between documents", "shards": "shards", "documents": "documents",
              "text_field": "text field"}
    for key, value in info.items():
        table.add_row(labels.get(key, key), f"{value:,}" if isinstance(value, int) else str(value))
    out.print(table)


@command.command("examples")
@click.option("-C", "--dir", "root", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Folder to write them under.")
@click.option("--force", is_flag=True, help="Replace files of these names that earlier examples did not write.")
def examples(root: Path, force: bool) -> None:
    """Write the README's example inputs, from this machine's Python standard library (no download).

    corpus/a.txt (text), corpus/docs.jsonl, .json, .csv (its column is body), .parquet and .arrow
    (accelrun[data]), corpus/saved (a save_to_disk folder; datasets), chats.jsonl, and
    models/my-chat-model: a tiny random Llama with a BPE tokenizer and a chat template whose
    {% generation %} blocks mark the assistant's turns (accelrun[hf]). Earlier copies are replaced;
    files of those names that are not earlier copies (your own corpus/a.txt) are not, without --force.

    \b
    Examples:
      accelrun data examples
      accelrun train configs/llama.yaml data.source=documents 'data.paths=[corpus/docs.parquet]'
    """
    from accelrun.data.examples import not_ours, write_examples

    if (theirs := not_ours(root)) and not force:
        raise click.UsageError(f"{', '.join(theirs)} under {root} are not examples this command wrote (or were "
                               "changed since): it would replace them; -C writes into another folder, --force "
                               "replaces them")
    report = write_examples(root)
    for w in report.written:
        out.print(f"wrote {escape(str(root / w.path) if root != Path('.') else w.path)}: {escape(w.what)}")
    for w in report.skipped:
        out.print(f"[yellow]skipped[/] {escape(w.path)}: {escape(w.what)}")

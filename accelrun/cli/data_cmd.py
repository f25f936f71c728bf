"""``accelrun data prepare``: tokenize text once into a memory-mappable token file."""

from __future__ import annotations

from pathlib import Path

import click
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

from accelrun.cli.common import err, out


@click.group("data")
def command() -> None:
    """Prepare training data.

    \b
    Example:
      accelrun data prepare 'corpus/**/*.txt' -o data/corpus.tok
    """


@command.command("prepare")
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Token file to write.")
@click.option("--max-bytes", type=click.IntRange(min=1), default=None, help="Read at most this many bytes of text.")
@click.option("--tokenizer", default="byte", show_default=True,
              help="byte, or a tokenizer.json / a Hugging Face folder holding one (needs accelrun[hf]).")
def prepare(inputs: tuple[str, ...], output: Path, max_bytes: int | None, tokenizer: str) -> None:
    """Tokenize text files or globs into one token file for `data.source: tokens`.

    The file records its tokenizer; a run reading it needs the same data.tokenizer.

    \b
    Examples:
      accelrun data prepare 'corpus/**/*.txt' -o data/corpus.tok
      accelrun train configs/llama.yaml data.source=tokens 'data.paths=[data/corpus.tok]'
      accelrun data prepare 'corpus/**/*.txt' -o data/corpus-bpe.tok --tokenizer models/my-tokenizer
    """
    from accelrun.data import prepare_tokens

    with Progress(*Progress.get_default_columns()[:1], BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("tokenizing", total=None)

        def on_progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        info = prepare_tokens(list(inputs), str(output), tokenizer=tokenizer, max_bytes=max_bytes,
                              progress=on_progress, tokenizer_key="--tokenizer")
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    labels = {"path": "written", "files": "input files", "bytes": "input bytes", "tokens": "tokens",
              "token_bytes": "bytes per token", "tokenizer": "tokenizer", "vocab_size": "vocabulary",
              "sha256": "sha256 of the tokens", "tokenizer_file": "tokenizer file",
              "between_documents": "between documents"}
    for key, value in info.items():
        table.add_row(labels.get(key, key), f"{value:,}" if isinstance(value, int) else str(value))
    out.print(table)

"""``accelrun recipes list | show | cp``: the recipes on the search path."""

from __future__ import annotations

import os
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from accelrun.cli.common import out, print_wide
from accelrun.config import ConfigError, list_recipes, search_path
from accelrun.config.search import RECIPE_PATH_ENV, find_recipe


@click.group("recipes")
def command() -> None:
    """List, show and copy recipes.

    Search path, first match wins: ./recipes, then $ACCELRUN_RECIPE_PATH (os.pathsep-separated),
    then the recipes shipped with accelrun.

    \b
    Examples:
      accelrun recipes list
      accelrun recipes show parallel/fsdp
      accelrun recipes cp model/debug recipes/model/mine.yaml
    """


@command.command("list")
@click.option("--all", "show_all", is_flag=True, help="Also list recipes shadowed by an earlier directory.")
def list_cmd(show_all: bool) -> None:
    """List recipe names with their one-line summaries.

    \b
    Examples:
      accelrun recipes list
      ACCELRUN_RECIPE_PATH=~/team-recipes accelrun recipes list --all
    """
    dirs = search_path()
    entries = list_recipes(dirs)
    hidden: dict[str, list[Path]] = {}  # name -> the files a first match hides
    for e in entries:
        if e.shadowed_by is not None:
            hidden.setdefault(e.name, []).append(e.path)
    rows = []
    for e in entries:
        if e.shadowed_by is not None and not show_all:
            continue
        summary = escape(e.summary)
        if e.shadowed_by is not None:
            summary += f" [yellow](shadowed by {escape(str(e.shadowed_by))})[/]"
        elif e.name in hidden:  # a local recipe that hides a shipped one: said, not silently in force
            summary += f" [yellow](hides {escape(', '.join(map(str, hidden[e.name])))})[/]"
        rows.append((e.name, summary, escape(str(e.path))))
    table = Table(show_edge=False, box=None, pad_edge=False)
    table.add_column("name", style="bold cyan", no_wrap=True)
    if out.is_terminal:
        table.add_column("summary", ratio=3)
        table.add_column("file", style="dim", overflow="fold", ratio=1)
        for name, summary, path in rows:
            table.add_row(name, summary, path)
        out.print(table)
    else:  # piped or logged: one line per recipe, its path whole (`| grep` finds it), the summary last
        table.add_column("file")
        table.add_column("summary")
        for name, summary, path in rows:
            table.add_row(name, path, summary)
        print_wide(table)
    out.print(f"\nsearch path ({RECIPE_PATH_ENV} adds directories): " + ", ".join(str(d) for d in dirs), style="dim")


@command.command("show")
@click.argument("name")
def show(name: str) -> None:
    """Print a recipe file as written (use `accelrun config show NAME` for the resolved values).

    \b
    Example:
      accelrun recipes show model/llama3-8b
    """
    path = find_recipe(name, search_path())
    out.print(f"# {path}", style="dim", markup=False)
    out.print(path.read_text(encoding="utf-8"), markup=False, end="")


@command.command("cp")
@click.argument("name")
@click.argument("dest", type=click.Path())  # a str: Path("./my-recipes/") would lose the slash that makes it a folder
@click.option("--force", is_flag=True, help="Overwrite DEST if it exists.")
def cp(name: str, dest: str, force: bool) -> None:
    """Copy a recipe to DEST (a file, or a directory to copy into) to edit it.

    \b
    Examples:
      accelrun recipes cp model/debug recipes/model/my-model.yaml
      accelrun recipes cp parallel/fsdp ./my-recipes/
    """
    src = find_recipe(name, search_path())
    folder = Path(dest)
    target = folder / src.name if folder.is_dir() or dest.endswith(("/", os.sep)) else folder
    if target.exists() and not force:
        raise ConfigError(f"{target} exists; pass --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    # A summary line of its own first: `recipes list` shows a recipe's first comment, and a copy listed
    # with the original's ("model/mine  debug: a tiny Llama...") read as the original (a trial's)
    text = src.read_text(encoding="utf-8")
    target.write_text(f"# {target.stem}: a copy of {name}; say here what it changes.\n{text}", encoding="utf-8")
    out.print(f"copied {src} -> {target}")

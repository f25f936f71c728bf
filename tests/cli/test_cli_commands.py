"""The CLI as a user drives it: exit codes, messages, and what each command prints or writes."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from accelrun import __version__
from accelrun.cli.main import cli
from tests.conftest import DEFAULT_CONFIG

COMMANDS = [[], ["train"], ["validate"], ["config"], ["config", "show"], ["recipes"], ["recipes", "list"],
            ["recipes", "show"], ["recipes", "cp"], ["data"], ["data", "prepare"]]


def invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0 and __version__ in r.output


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "accelrun")
def test_every_command_has_help_with_examples(cmd):
    r = invoke(*cmd, "--help")
    assert r.exit_code == 0 and "Example" in r.output


def test_validate_ok_prints_summary():
    r = invoke("validate", DEFAULT_CONFIG)
    assert r.exit_code == 0, r.output
    assert "valid" in r.output and "config hash" in r.output and "data-parallel 1" in r.output


def test_validate_typo_exits_2_with_location_and_suggestion(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {DEFAULT_CONFIG}\ntrain:\n  stesp: 5\n")
    r = invoke("validate", bad)
    assert r.exit_code == 2
    assert f"{bad}:3: unknown key 'train.stesp'; did you mean 'train.steps'?" in r.output
    assert "Traceback" not in r.output


def test_yaml_syntax_error_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 3\n")
    r = invoke("validate", bad)
    assert r.exit_code == 2 and "YAML syntax error" in r.output and f"{bad}:2:1" in r.output


def test_missing_config_file_exits_2(tmp_path):
    r = invoke("train", tmp_path / "nope.yaml")
    assert r.exit_code == 2 and "config file not found" in r.output


def test_debug_flag_shows_the_traceback_and_keeps_the_exit_code(tmp_path):
    r = invoke("--debug", "validate", DEFAULT_CONFIG, "trian.steps=1")
    said = r.output + r.stderr
    assert r.exit_code == 2, said  # (it exited 1 with --debug: scripts reading 2 broke)
    assert "Traceback (most recent call last)" in said and "ConfigError" in said, said
    assert "error: override 'trian.steps=1': unknown key 'trian'" in said
    r = invoke("validate", DEFAULT_CONFIG, "--debug")  # after the command: says where it goes
    assert r.exit_code == 2 and "it goes before the command (accelrun --debug train ...)" in r.output, r.output


def test_config_show_resolved_yaml_and_explain():
    r = invoke("config", "show", DEFAULT_CONFIG, "train.steps=7")
    assert r.exit_code == 0
    doc = yaml.safe_load(r.stdout)  # warnings go to stderr
    assert doc["train"]["steps"] == 7 and doc["model"]["dim"] > 0
    r = invoke("config", "show", DEFAULT_CONFIG, "train.steps=7", "--explain")
    assert r.exit_code == 0
    assert "override 'train.steps=7'" in r.output and "recipes/model/debug.yaml" in r.output


def test_recipes_list_show_cp(tmp_path):
    r = invoke("recipes", "list")
    assert r.exit_code == 0 and "model/llama3-8b" in r.output and "parallel/fsdp" in r.output
    # Piped (not a terminal): one line per recipe with its file whole, so `| grep` finds both, the
    # summary last and no line filled with blanks to the widest one (a new user's `| less`)
    line = next(ln for ln in r.output.splitlines() if ln.startswith("cluster/cpu-local "))
    assert line.split()[1].endswith("recipes/cluster/cpu-local.yaml") and line.endswith("accelrun/plan/).")
    assert not [ln for ln in r.output.splitlines() if ln != ln.rstrip()]
    r = invoke("recipes", "show", "model/llama3-8b")
    assert r.exit_code == 0 and "dim: 4096" in r.output
    r = invoke("recipes", "cp", "model/debug", tmp_path)
    assert r.exit_code == 0 and (tmp_path / "debug.yaml").is_file()
    from accelrun.config import load_config
    from accelrun.config.search import (
        _summary,  # a copy lists with a summary of its own (it had the original's)
    )
    assert _summary(tmp_path / "debug.yaml") == "debug: a copy of model/debug; say here what it changes."
    assert load_config(tmp_path / "debug.yaml", []).config.model.dim == load_config("model/debug", []).config.model.dim
    r = invoke("recipes", "cp", "model/debug", tmp_path)
    assert r.exit_code == 2 and "--force" in r.output
    # the --help example's trailing slash names a folder that does not exist yet: made, copied into
    # (it wrote a file named my-recipes)
    r = invoke("recipes", "cp", "parallel/fsdp", f"{tmp_path}/my-recipes/")
    assert r.exit_code == 0 and (tmp_path / "my-recipes" / "fsdp.yaml").is_file(), r.output
    r = invoke("recipes", "show", "model/llama3-8", )
    assert r.exit_code == 2 and "did you mean" in r.output


def test_recipes_list_says_which_shipped_recipe_a_local_one_hides(tmp_path, monkeypatch):
    """A team's recipes/model/debug.yaml took the shipped model/debug's place with nothing said: the list
    showed one model/debug, the local one, as if it were the shipped recipe."""
    (tmp_path / "recipes" / "model").mkdir(parents=True)
    (tmp_path / "recipes" / "model" / "debug.yaml").write_text("# Our debug model.\nmodel: {dim: 64}\n")
    monkeypatch.chdir(tmp_path)
    lines = [ln for ln in invoke("recipes", "list").output.splitlines() if ln.startswith("model/debug ")]
    assert len(lines) == 1 and "recipes/model/debug.yaml" in lines[0].split()[1], lines
    assert lines[0].split()[1].startswith(str(tmp_path)) and "Our debug model. (hides " in lines[0], lines
    shipped = [ln for ln in invoke("recipes", "list", "--all").output.splitlines() if "(shadowed by " in ln]
    assert len(shipped) == 1 and shipped[0].startswith("model/debug "), shipped


def test_train_tiny_run(tiny, tmp_path):
    r = invoke("train", DEFAULT_CONFIG, *tiny(3, "checkpoint.enabled=false"))
    assert r.exit_code == 0, r.output
    (run_dir,) = list((tmp_path / "runs" / "llama-debug").iterdir())
    assert json.loads((run_dir / "report.json").read_text())["steps"] == 3
    assert (run_dir / "command.txt").read_text().startswith("accelrun")


def test_data_prepare_then_train_on_tokens(tiny, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(f"document {i} " * 2000)
    out = tmp_path / "tokens.bin"
    r = invoke("data", "prepare", str(corpus / "*.txt"), "-o", out)
    assert r.exit_code == 0, r.output
    assert out.is_file()
    rows = {" ".join(line.split()[:-1]): line.split()[-1] for line in r.output.splitlines() if line.strip()}
    assert rows["input files"] == "3" and rows["tokens"] == f"{3 * len('document 0 ') * 2000 + 3:,}"
    r = invoke("train", DEFAULT_CONFIG, *tiny(2, "checkpoint.enabled=false", "data.source=tokens",
                                              f"data.paths=[{out}]"))
    assert r.exit_code == 0, r.output
    r = invoke("train", DEFAULT_CONFIG, *tiny(2, "data.source=text", f"data.paths=[{tmp_path}/none*.txt]"))
    assert r.exit_code == 2 and "none*.txt" in r.output


def test_data_prepare_error_is_one_line(tmp_path):
    # No progress bar off a terminal: its closing newline came before the error.
    r = invoke("data", "prepare", str(tmp_path / "none*.txt"), "-o", tmp_path / "t.tok")
    assert r.exit_code == 2 and r.output.splitlines() == [f"error: inputs: '{tmp_path}/none*.txt' matched no files"]
    assert not (tmp_path / "t.tok").exists()
    (tmp_path / "a.txt").write_text("text")
    for bad, says in [(["-o", tmp_path], "is a directory"), (["-o", tmp_path / "t.tok", "--max-bytes", "0"], "0")]:
        r = invoke("data", "prepare", str(tmp_path / "a.txt"), *bad)  # before any text is encoded
        assert r.exit_code == 2 and says in r.output.splitlines()[-1], r.output
    assert not (tmp_path / "t.tok").exists()


@pytest.mark.parametrize("override", ["trian=[/x]", "trian.x=[abc]"])
def test_user_text_is_not_read_as_markup(override):
    r = invoke("validate", DEFAULT_CONFIG, override)
    assert r.exit_code == 2 and f"override '{override}'" in r.output


@pytest.mark.parametrize(
    "text, expect",
    [
        ("train:\n  steps: !!int abc\n", "YAML value error"),
        (b"train:\n  steps: \xff\xfe\n", "not UTF-8"),
    ],
)
def test_bad_yaml_values_exit_2(tmp_path, text, expect):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    r = invoke("validate", bad)
    assert r.exit_code == 2 and expect in r.output


def test_values_with_no_effect_are_warned_about():
    r = invoke("validate", DEFAULT_CONFIG, "compile.backend=eager", "compile.scope=model")
    assert r.exit_code == 0
    assert "warning: compile.scope (override 'compile.scope=model') has no effect" in r.stderr


def test_setup_error_leaves_no_run_directory(tiny, tmp_path):
    r = invoke("train", DEFAULT_CONFIG, *tiny(2, "data.source=text", f"data.paths=[{tmp_path}/none*.txt]"))
    assert r.exit_code == 2
    assert not list((tmp_path / "runs").glob("*/*"))


def test_train_dry_run_builds_every_rank_and_refuses_what_train_would(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke("train", DEFAULT_CONFIG, "parallel.nproc_per_node=4", "parallel.tp=2", "--dry-run", "--all-ranks")
    assert r.exit_code == 0, r.output
    rows = [line.split() for line in r.output.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert len(rows) == 4 and all(row[-1] == "1.000" for row in rows), r.output
    assert not (tmp_path / "runs").exists()  # nothing trained, no run folder
    r = invoke("train", DEFAULT_CONFIG, "parallel.nproc_per_node=2", "parallel.pp=2", "parallel.dp_shard=1",
               "model.tie_embeddings=true", "--dry-run")
    assert r.exit_code == 2 and "model.tie_embeddings" in r.output


def test_a_reader_that_stops_early_is_not_an_error():
    """`accelrun ... | head`: the command's output after the reader stopped goes nowhere and it exits 0
    with nothing on stderr (rich's default exits 1, which a script reads as the command failing)."""
    import subprocess
    import sys

    code = ("import sys; from accelrun.cli.main import cli; "
            "sys.argv = ['accelrun', 'recipes', 'list']; cli()")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader has gone before the first line (head -0): every write meets a closed pipe
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 0 and stderr == b"", stderr.decode()


def test_a_reader_of_stderr_that_stops_early_is_not_an_error():
    """`accelrun ... 2>&1 | head`, and a closed stderr alone: a warning meets the closed pipe, and the
    command goes on to its end: the same result on stdout, exit 0 (rich's default exits 1 at once)."""
    import subprocess
    import sys

    code = ("import sys; from accelrun.cli.main import cli; sys.argv = ['accelrun', 'config', 'show', "
            f"{str(DEFAULT_CONFIG)!r}, 'compile.backend=eager', 'compile.scope=block']; cli()")
    whole = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert whole.returncode == 0 and b"compile.scope" in whole.stderr and b"warning" in whole.stderr
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stderr.close()  # nobody reads the warnings
    stdout, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and stdout == whole.stdout
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    p.stdout.close()  # 2>&1 | head -0
    p.wait(timeout=120)
    assert p.returncode == 0


def test_an_option_that_is_a_recipe_key_points_at_the_override():
    """`accelrun train configs/llama.yaml --steps 10`, as other tools take it: the message names train.steps=..."""
    r = invoke("train", DEFAULT_CONFIG, "--steps", "10")
    assert r.exit_code == 2 and "did you mean train.steps=VALUE (or eval.steps)?" in " ".join(r.output.split())
    r = invoke("validate", DEFAULT_CONFIG, "--lr", "0.1")
    assert r.exit_code == 2 and "did you mean train.optimizer.lr=VALUE?" in " ".join(r.output.split())
    r = invoke("train", DEFAULT_CONFIG, "--max-steps", "10")  # another tool's name for it
    assert r.exit_code == 2 and "did you mean train.steps=VALUE" in " ".join(r.output.split())
    r = invoke("train", DEFAULT_CONFIG, "--bogus")  # no such key either: click's own message
    assert r.exit_code == 2 and "No such option" in r.output and "KEY=VALUE arguments" not in r.output
    r = invoke("runs", "list", "--steps")  # a command without overrides: nothing to point at
    assert r.exit_code == 2 and "KEY=VALUE arguments" not in r.output


@pytest.mark.parametrize("flags", [[], ["--dry-run"]], ids=["train", "train --dry-run"])
def test_train_reports_a_recipe_mistake_before_importing_torch(tmp_path, flags):
    # A mistake in the recipe is the commonest first error: it is reported (exit 2) before torch and
    # torchrun's launcher load, which took 3 s of the 3.5 a misspelt key cost. Torch made
    # unimportable proves the order without timing anything.
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {DEFAULT_CONFIG}\ntrain:\n  stesp: 5\n")
    code = ("import sys; sys.modules['torch'] = None; from accelrun.cli.main import main; "
            f"sys.argv = ['accelrun', 'train', {str(bad)!r}, *{flags!r}]; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "bad.yaml:3: unknown key 'train.stesp'; did you mean 'train.steps'?" in r.stderr

"""A shared recipe cannot hang validation or slip nonsense numbers past it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from accelrun.config import ConfigError, load_config
from tests.conftest import REPO

BOMB = "".join(
    f"{k}: &{k} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
    for p, k in zip(["", *"abcdefgh"], "abcdefghi", strict=True)
)  # 9 ** 9 = 387 M strings once expanded


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides), search_dirs=[])
    return str(e.value)


def test_alias_bomb_is_refused_quickly_and_small(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    # In a child with a 1 GiB address-space cap: without the bound it would grow past it (and take minutes).
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30));"
            "from accelrun.cli.main import main; sys.argv = ['accelrun', 'validate', sys.argv[1]]; main()")
    r = subprocess.run([sys.executable, "-c", code, str(bomb)], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert f"{bomb}:1: this YAML expands to more than 100,000 values" in r.stderr


def test_alias_cycle_and_alias_in_an_override(write):
    p = write("cycle.yaml", "a: &a\n  b: *a\n")
    assert "a YAML alias refers to a value that contains it" in error_of(p)
    ok = write("ok.yaml", "name: x\n")
    assert "expands to more than" in error_of(ok, ["model.kwargs=" + "{" + BOMB.replace("\n", ", ") + "}"])


def test_ordinary_anchors_still_work(write):
    p = write("anchors.yaml", "name: x\ntrain: &t\n  steps: 7\n  seed: 3\n")
    assert load_config(p, search_dirs=[]).config.train.steps == 7


@pytest.mark.parametrize("override, expect", [
    ("model.dim=true", "model.dim: expected a number, got a boolean"),
    ("train.grad_clip=false", "train.grad_clip: expected a number, got a boolean"),
    ("train.optimizer.betas=[true, 0.9]", "train.optimizer.betas: expected a number, got a boolean"),
    ("parallel.pp_layers=[[true], [1]]", "parallel.pp_layers: expected a number, got a boolean"),
    ("train.optimizer.lr=.inf", "train.optimizer.lr: input should be a finite number"),
    ("train.optimizer.lr=.nan", "train.optimizer.lr: input should be a finite number"),
    ("model.norm_eps=-.inf", "model.norm_eps: input should be a finite number"),
])
def test_booleans_and_non_finite_numbers_are_refused(write, override, expect):
    p = write("ok.yaml", "name: x\n")
    msg = error_of(p, [override])
    assert expect in msg and f"override '{override}'" in msg


def test_a_quoted_number_is_refused_where_a_number_is_wanted(write):
    """A team's recipe with `dim: "256"` was read as 256 by pydantic's lax mode, while `"true"` and
    `true` were refused: a quoted number is a string, and a string where a number goes is a mistake."""
    p = write("quoted.yaml", 'name: x\nmodel:\n  dim: "192"\n')
    msg = error_of(p, [])
    assert "quoted.yaml:3" in msg and "model.dim: expected a number, got the string '192' (write it without " \
        "quotes: 192)" in msg, msg
    ok = write("ok.yaml", "name: x\n")
    msg = error_of(ok, ['train.optimizer.lr="1e-3"'])
    assert "train.optimizer.lr: expected a number, got the string '1e-3'" in msg, msg
    # Unquoted, an exponent without a point is a number (PyYAML alone reads 1e-3 as a string).
    assert load_config(ok, ["train.optimizer.lr=1e-3"], search_dirs=[]).config.train.optimizer.lr == 1e-3
    assert load_config(ok, ['name="256"'], search_dirs=[]).config.name == "256"  # a string field takes it
    # a quoted number in a list of numbers too
    assert "got the string '0.9'" in error_of(ok, ["train.optimizer.betas=['0.9', 0.95]"])
    # YAML 1.2's floats are numbers, not quoted strings (a review: `rope_theta: 5.0e5` was refused)
    for text, value in (("5.0e5", 5.0e5), ("1.0e6", 1.0e6), ("2.5E4", 2.5e4)):
        assert load_config(ok, [f"model.rope_theta={text}"], search_dirs=[]).config.model.rope_theta == value
    import yaml

    from accelrun.config.yaml_lines import RecipeLoader

    assert yaml.load("[-.5, .5, 3., 7, 1_000]", Loader=RecipeLoader) == [-0.5, 0.5, 3.0, 7, 1000]
    floats = write("floats.yaml", "name: x\nmodel:\n  rope_theta: 5.0e5\n  norm_eps: 1.0e-5\n")
    assert load_config(floats, search_dirs=[]).config.model.rope_theta == 5.0e5


def test_our_own_validators_speak_once_and_suggest(write, monkeypatch):
    """A validator's own message comes without pydantic's "Value error," and without a second "(got ...)";
    a module path written with a dot for the colon is offered with the colon where the module has that
    callable, and a module named alone is offered with its callables (found by importing it: a guess
    from the text alone offered 'mymodels:mha' for the module mymodels.mha, which has no such attribute)."""
    p = write("ok.yaml", "name: x\n")
    pkg = p.parent / "mymodels_s70"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "gru.py").write_text("def build():\n    return None\n\nclass Net:\n    pass\n")
    monkeypatch.syspath_prepend(str(p.parent))
    msg = error_of(p, ["model.custom=mymodels_s70.gru.build"])
    assert msg.endswith("""model.custom: expected "package.module:factory", got 'mymodels_s70.gru.build'; did you """
                        "mean 'mymodels_s70.gru:build'?"), msg
    msg = error_of(p, ["model.custom=mymodels_s70.gru"])
    assert msg.endswith("did you mean 'mymodels_s70.gru:<factory>'? (its callables: build, Net)"), msg
    msg = error_of(p, ["model.custom=no_such_pkg_s70.gru"])
    assert msg.endswith("""expected "package.module:factory", got 'no_such_pkg_s70.gru'"""), msg
    # a file's path: its module, and its likely factory (the README's promise; a trial got no line to write)
    msg = error_of(p, ["model.custom=mymodels_s70/gru.py"])
    assert msg.endswith("a file is named by its module: did you mean 'mymodels_s70.gru:build'? (its callables: "
                        "build, Net)"), msg


def test_a_file_value_names_file_and_line(write):
    p = write("bad.yaml", "name: x\nmodel:\n  dim: yes\n")
    msg = error_of(p)
    assert f"{p}:3" in msg and "expected a number, got a boolean" in msg


def test_booleans_stay_booleans_where_they_belong(write):
    p = write("ok.yaml", "name: x\n")
    assert load_config(p, ["model.tie_embeddings=true"], search_dirs=[]).config.model.tie_embeddings is True


@pytest.mark.parametrize("content, expect", [
    (b"", "the recipe is empty"),
    (b"# a comment only\n\n", "the recipe is empty"),
    (b"{}\n", "the recipe is empty"),
    (b"a\x00b: 1\n", "not YAML text (character 0x0 at offset 1)"),
    (bytes(range(256)), "not UTF-8 text"),
])
def test_empty_and_binary_recipe_files_exit_2_naming_the_file(tmp_path, content, expect):
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    p = tmp_path / "r.yaml"
    p.write_bytes(content)
    r = CliRunner().invoke(cli, ["validate", str(p)])
    assert r.exit_code == 2 and r.output.startswith(f"error: {p}") and expect in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1

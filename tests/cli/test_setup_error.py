"""A run whose setup fails on the user's input (a bad record, found while reading the data) announced
its folder before it failed: the folder is removed, since nothing ran, and the output says so."""

from __future__ import annotations

from click.testing import CliRunner

from accelrun.cli.main import cli
from tests.conftest import DEFAULT_CONFIG, TINY


def test_a_data_error_in_setup_exits_2_and_says_the_announced_folder_is_gone(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "hello world"}\n{"text": 5}\n')
    runs = tmp_path / "runs"
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *TINY, "data.source=documents",
                                 f"data.paths=[{corpus}]", f"report.runs_dir={runs}"])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert f"{corpus}:2: data.text_field 'text' is int 5, not text" in r.output
    announced = next(line for line in r.output.splitlines() if line.startswith("accelrun run "))
    folder = announced.split()[2]
    assert f"nothing ran: {folder} removed" in r.output
    assert not any(p.is_dir() for p in runs.rglob("*") if p.parent.parent == runs)  # no run folder left
    assert "Traceback" not in r.output


def test_a_model_output_refused_at_the_first_step_leaves_no_crashed_folder(tmp_path, monkeypatch):
    """A user's model whose logits have the wrong shape is refused (exit 2) when its first step runs:
    as with a setup error, nothing ran, so no folder is left for `runs list` to call crashed."""
    (tmp_path / "flat_model.py").write_text(
        "from torch import nn\n"
        "class Flat(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.head = nn.Embedding(320, 8), nn.Linear(8, 320)\n"
        "    def forward(self, tokens):\n"
        "        return self.head(self.emb(tokens)).flatten(0, 1)  # (B*T, V): the mistake\n"
        "def build():\n"
        "    return Flat()\n")
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *TINY, "model.custom=flat_model:build",
                                 "compile.backend=eager", f"report.runs_dir={runs}"])
    assert r.exit_code == 2, r.output
    assert "returned logits of shape" in r.output and "nothing ran:" in r.output, r.output
    assert not any(p.is_dir() for p in runs.rglob("*") if p.parent.parent == runs)

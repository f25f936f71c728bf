"""Docs that must not contradict each other or the code (issue 30, item 10)."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from accelrun.cli.main import cli
from tests.conftest import REPO

HF_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
             "intermediate_size": 128, "vocab_size": 512}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else None]


def test_no_config_says_the_triton_path_never_ran_on_a_gpu_once_docs_say_it_did():
    assert "## Seen on an H100" in (REPO / "docs" / "gpu.md").read_text()
    stale = [p.name for p in (REPO / "configs").glob("*.yaml")
             if re.search(r"not\s+(yet\s+)?run\s+on\s+a\s+GPU", " ".join(p.read_text().split("#")))]
    assert not stale, f"comments say accelrun's Triton path has not run on a GPU: {stale}"


def test_the_hf_section_says_a_folder_without_a_tokenizer_needs_the_byte_tokenizer(tmp_path):
    assert "data.tokenizer=byte" in _section((REPO / "README.md").read_text(), "## Bring a Hugging Face model")
    # ... and what it says is what validation says for such a folder.
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    r = CliRunner().invoke(cli, ["validate", str(REPO / "configs" / "hf-llama.yaml"), f"model.hf={tmp_path}"])
    assert r.exit_code == 2 and "data.tokenizer=byte" in r.stderr, r.output


def test_the_readme_s_table_of_shipped_recipes_names_every_one():
    table = _section((REPO / "README.md").read_text(), "Shipped recipes:")
    listed = {(family, name) for family, names in re.findall(r"^\| `(\w+)/` \| (.*) \|$", table, re.M)
              for name in re.findall(r"`([\w.-]+)`", names)}
    shipped = {(p.parent.name, p.stem) for p in (REPO / "recipes").glob("*/*.yaml")}
    assert shipped and shipped <= listed, sorted(shipped - listed)

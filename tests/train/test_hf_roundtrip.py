"""Hugging Face round trip: a transformers checkpoint → accelrun trains it → export → transformers loads
it with accelrun's logits."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.train.generate import load_run_model
from tests.conftest import DEFAULT_CONFIG
from tests.models.hf_helpers import save_tiny_hf

TOL = 1e-5


def _accelrun_logits(run_dir, tokens):
    """accelrun's own model from the run's final checkpoint (independent of the export code)."""
    with torch.no_grad():
        return load_run_model(run_dir)(tokens)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma", "mistral"])
def test_hf_train_export_transformers_loads(tiny, tmp_path, kind):
    import transformers

    src = tmp_path / "src"
    original = save_tiny_hf(src, kind)
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG),
                                 *tiny(2, f"model.hf={src}", "checkpoint.hf_on_finish=true")])
    assert r.exit_code == 0, r.output
    (run_dir,) = list((tmp_path / "runs" / "llama-debug").iterdir())
    assert json.loads((run_dir / "report.json").read_text())["steps"] == 2

    out = tmp_path / "exported"
    r = CliRunner().invoke(cli, ["export", str(run_dir), "--hf", str(out), "--max-shard-gb", "0.0001"])
    assert r.exit_code == 0, r.output
    assert (out / "model.safetensors.index.json").is_file()  # ~100 KiB shards: several files
    # which checkpoint a run folder stood for (its newest) is said
    assert f"files to {out} from {run_dir / 'checkpoints'}" in " ".join(r.output.split()), r.output

    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = _accelrun_logits(run_dir, tokens)
    with torch.no_grad():
        before = original(tokens).logits
        for folder in (out, run_dir / "hf"):  # the command's export and hf_on_finish's
            back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
            assert type(back).__name__ == type(original).__name__
            diff = (back(tokens).logits - ours).abs().max().item()
            assert diff < TOL, f"{folder}: max |logit difference| {diff:.2e}"
    # Two steps of training moved the weights: the round trip carried the trained ones, not the originals.
    assert (ours - before).abs().max() > 1e-3
    # What the source folder says of the model beyond its shape comes along (a new user's Mistral came
    # back a Llama attending to every position, and no export stopped generating at EOS).
    source = json.loads((src / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    for key in ("model_type", "architectures", "max_position_embeddings", "sliding_window", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert exported.get(key) == source.get(key), (key, exported.get(key), source.get(key))
    assert (out / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    assert exported.get("dtype", "float32") == "float32" and exported["torch_dtype"] == "float32"


def test_hf_folder_without_weights_exits_2_before_a_run_directory(tiny, tmp_path):
    src = tmp_path / "src"
    save_tiny_hf(src, "llama")
    (src / "model.safetensors").unlink()
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(2, f"model.hf={src}")])
    errors = [line for line in r.output.splitlines() if not line.startswith("warning:")]  # tiny's shape keys
    assert r.exit_code == 2 and errors == [f"error: model.hf: {src} holds no *.safetensors files "
                                           f"(model.hf: override 'model.hf={src}')"]
    assert not (tmp_path / "runs").exists()


def test_export_of_a_folder_without_checkpoints_exits_2(tmp_path):
    r = CliRunner().invoke(cli, ["export", str(tmp_path), "--hf", str(tmp_path / "out")])
    assert r.exit_code == 2 and "not a run directory" in r.output
    assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("x")
    r = CliRunner().invoke(cli, ["export", str(tmp_path), "--hf", str(tmp_path / "file")])
    assert r.exit_code == 2 and r.output.splitlines() == [f"error: --hf: {tmp_path / 'file'} is a file; give a "
                                                          "folder (created if missing)"]

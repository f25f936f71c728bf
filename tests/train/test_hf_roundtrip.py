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
    # back a Llama attending to every position); its token ids only with its tokenizer (this run's
    # is the byte tokenizer: test_an_export_keeps_the_folders_token_ids_with_its_tokenizer).
    source = json.loads((src / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    for key in ("model_type", "architectures", "max_position_embeddings") + (("sliding_window",) if kind == "mistral" else ()):
        assert key in source and exported[key] == source[key], (key, exported.get(key), source.get(key))
    assert exported.get("dtype", "float32") == "float32" and exported["torch_dtype"] == "float32"
    assert not (out / "generation_config.json").exists()
    # the byte tokenizer's own ids (transformers' defaults, eos 2 and bos 1, had stood: a new user's
    # export stopped generating at '!')
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (256, 257)
    assert "did not train with" in " ".join(r.output.split()), r.output  # and the export says so
    if kind == "mistral":  # the folder gone since training: the export says what it could not carry
        import shutil

        shutil.rmtree(src)
        r = CliRunner().invoke(cli, ["export", str(run_dir), "--hf", str(tmp_path / "again")])
        assert r.exit_code == 0 and "has no config.json now" in " ".join(r.output.split()), r.output


def test_an_export_keeps_the_folders_token_ids_with_its_tokenizer_and_refuses_the_folder_itself(tiny, tmp_path):
    """Trained with the model.hf folder's own tokenizer, the export carries its BOS/EOS/pad ids and its
    generation_config.json (a fine-tuned export's generate() never stopped at EOS: a new user); an
    export into that folder would replace its weights (refused, exit 2); a folder gone since says so."""
    import shutil

    from tests.data.chat_helpers import save_chat_tokenizer

    src = tmp_path / "src"
    save_tiny_hf(src, "mistral")
    save_chat_tokenizer(src)  # 300 ids, in the model's 320
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(2, f"model.hf={src}", "data.tokenizer=hf")])
    assert r.exit_code == 0, r.output
    (run_dir,) = list((tmp_path / "runs" / "llama-debug").iterdir())
    out = tmp_path / "exported"
    r = CliRunner().invoke(cli, ["export", str(run_dir), "--hf", str(out)])
    assert r.exit_code == 0, r.output
    source, exported = (json.loads((d / "config.json").read_text()) for d in (src, out))
    for key in ("bos_token_id", "eos_token_id", "model_type", "sliding_window"):
        assert key in source and exported[key] == source[key], key
    assert (out / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    r = CliRunner().invoke(cli, ["export", str(run_dir), "--hf", str(src)])
    assert r.exit_code == 2 and "is the folder the run was trained from (model.hf)" in " ".join(r.output.split())
    shutil.rmtree(src)  # its tokenizer with it: the export would have none
    r = CliRunner().invoke(cli, ["export", str(run_dir), "--hf", str(tmp_path / "again")])
    assert r.exit_code == 2 and "the export would have no tokenizer" in " ".join(r.output.split()), r.output


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


def test_an_export_into_the_run_folder_itself_or_its_checkpoints_exits_2(tiny, tmp_path):
    # A new user's trial (2026-12-07) exported into the run folder: config.json and weights beside the run's.
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(2)])
    assert r.exit_code == 0, r.output
    (run_dir,) = list((tmp_path / "runs" / "llama-debug").iterdir())
    before = sorted(p.name for p in run_dir.iterdir())
    for out, said in ((run_dir, f"is the run folder {run_dir.resolve()}"),
                      (run_dir / "checkpoints" / "mine", "is inside the checkpoints of"),
                      (run_dir.parent, "is a folder of runs")):
        r = CliRunner().invoke(cli, ["export", str(run_dir), "--hf", str(out)])
        assert r.exit_code == 2 and said in " ".join(r.output.split()), r.output
        assert f"such as {run_dir.resolve() / 'hf'}" in " ".join(r.output.split()) or out == run_dir.parent
    assert sorted(p.name for p in run_dir.iterdir()) == before
    assert not (run_dir / "checkpoints" / "mine").exists()
    r = CliRunner().invoke(cli, ["export", str(run_dir), "--hf", str(run_dir / "hf")])  # hf_on_finish's own folder
    assert r.exit_code == 0 and (run_dir / "hf" / "config.json").is_file(), r.output


def test_an_export_of_a_run_with_its_own_tokenizer_json_says_its_end_of_text_id(tiny, tmp_path):
    # A new user's BPE tokenizer (its <eos> id 1): the export's config.json had no ids, transformers took
    # eos 2 ('!') and bos 1 (their end-of-text), and generate() stopped at the wrong token.
    from accelrun.config.tokenizer_file import read_tokenizer_info
    from tests.data.chat_helpers import save_chat_tokenizer

    tok = tmp_path / "tok"
    save_chat_tokenizer(tok)
    eos = read_tokenizer_info(str(tok)).eos_id
    assert eos is not None
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *tiny(2, f"data.tokenizer={tok}")])
    assert r.exit_code == 0, r.output
    (run_dir,) = list((tmp_path / "runs" / "llama-debug").iterdir())
    r = CliRunner().invoke(cli, ["export", str(run_dir), "--hf", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["eos_token_id"] == eos and (tmp_path / "out" / "tokenizer.json").is_file()

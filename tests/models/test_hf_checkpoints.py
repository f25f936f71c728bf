"""model.hf: a transformers folder read into accelrun's Llama family gives transformers' logits; bad
folders are one clear error each."""

from __future__ import annotations

import json

import pytest
import torch

from accelrun.config.errors import ConfigError
from accelrun.config.schema import ModelConfig
from accelrun.models import build_model
from accelrun.models.hf_io import HFCheckpointError, load_hf_for_config
from tests.models.hf_helpers import save_tiny_hf

TOL = 1e-5  # fp32, same weights, different kernels and op order


def _accelrun(folder, **overrides):
    cfg = ModelConfig(hf=str(folder), **overrides)
    model = build_model(cfg, "cpu", seed=0)
    load_hf_for_config([model], cfg)
    return model.eval(), cfg


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "mistral", "tied"])
def test_logits_equal_transformers(tmp_path, kind):
    hf = save_tiny_hf(tmp_path, kind)
    ours, cfg = _accelrun(tmp_path)
    assert cfg.tie_embeddings == (kind == "tied") and cfg.qkv_bias == (kind == "qwen2")
    assert (cfg.rope_scaling is not None) == (kind == "llama3")
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < TOL, f"{kind}: max |logit difference| {diff:.2e}"


def test_rope_scaling_changes_the_logits(tmp_path):
    # The llama3 case above proves something only if the scaling matters at these shapes.
    hf = save_tiny_hf(tmp_path, "llama3")
    ours, _ = _accelrun(tmp_path)
    unscaled, _ = _accelrun(tmp_path)
    unscaled.args = type(unscaled.args)(**{**unscaled.args.__dict__, "rope_scaling": None})
    unscaled.init_buffers()
    tokens = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (unscaled(tokens) - hf(tokens).logits).abs().max() > 1e-3
        assert (ours(tokens) - hf(tokens).logits).abs().max() < TOL


def test_sharded_folder_with_index_and_bf16_weights(tmp_path):
    hf = save_tiny_hf(tmp_path, "llama", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    ours, _ = _accelrun(tmp_path)
    tokens = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() < TOL
    # bf16 files are read in their dtype and converted once into the fp32 parameters.
    bf16 = tmp_path / "bf16"
    hf.to(torch.bfloat16).save_pretrained(bf16)
    ours16, _ = _accelrun(bf16)
    assert torch.equal(ours16.tok_embeddings.weight, hf.model.embed_tokens.weight.float())


def test_shape_keys_come_from_config_json(tmp_path):
    save_tiny_hf(tmp_path, "llama")
    cfg = ModelConfig(hf=str(tmp_path), dim=999, n_layers=7)  # a base recipe's shape does not win
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (64, 2, 4, 2, 112, 320)


def test_keys_a_config_leaves_out_take_transformers_class_defaults(tmp_path):
    """A hand-written Mistral config.json without sliding_window or num_key_value_heads: transformers'
    MistralConfig gives 4096 and 8; they read as no window and full-width KV heads (a trial's reading)."""
    from transformers import MistralConfig

    save_tiny_hf(tmp_path, "mistral")
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("sliding_window", "num_key_value_heads", "max_position_embeddings", "head_dim"):
        config.pop(key)
    config["num_attention_heads"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    theirs = MistralConfig(**config)
    cfg = ModelConfig(hf=str(tmp_path))
    assert cfg.n_kv_heads == theirs.num_key_value_heads == 8
    assert cfg.max_seq_len == theirs.sliding_window == 4096  # full attention up to the window


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_attention_dropout_is_refused_not_trained_without(tmp_path, kind):
    save_tiny_hf(tmp_path, kind)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    with pytest.raises(ConfigError, match=r"config.json: attention_dropout = 0.5 is not supported \(only 0"):
        ModelConfig(hf=str(tmp_path))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"'gpt2'.*supported: llama \(LlamaForCausalLM\), mistral.*qwen2"):
        ModelConfig(hf=str(tmp_path))


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match=r"config.json not found"):
        ModelConfig(hf=str(tmp_path))


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    save_tiny_hf(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(HFCheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
                                                r"has shape \(112, 64\).*needs \(96, 64\)"):
        _accelrun(tmp_path)


def test_missing_shard_and_truncated_file(tmp_path):
    save_tiny_hf(tmp_path / "a", "llama", max_shard_size="40KB")
    victim = sorted((tmp_path / "a").glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(HFCheckpointError, match=rf"names {victim.name}.*missing shard"):
        _accelrun(tmp_path / "a")
    save_tiny_hf(tmp_path / "b", "llama")
    f = tmp_path / "b" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(HFCheckpointError, match=r"model.safetensors"):
        _accelrun(tmp_path / "b")


def test_reading_a_region_equals_slicing_the_whole_tensor(tmp_path):
    # What an FSDP / TP rank reads: its rows (q/k widened to whole heads for the rotary permutation,
    # then cut back) or columns, never the whole tensor.
    from safetensors import safe_open

    from accelrun.models.families import get_family
    from accelrun.models.hf_io import _read_region

    save_tiny_hf(tmp_path, "llama")
    spec = get_family("llama")
    cfg = ModelConfig(hf=str(tmp_path))
    args = spec.args_from_config(cfg)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for name, region in [("layers.0.attention.wq.weight", (slice(5, 37), slice(0, 64))),  # not head-aligned
                             ("layers.1.attention.wk.weight", (slice(16, 32), slice(0, 64))),
                             ("layers.0.attention.wo.weight", (slice(0, 64), slice(21, 43)))]:
            hf = spec.hf_name(name, args)
            whole = spec.hf_from_tensor(name, f.get_tensor(hf), args)
            part = _read_region(f.get_slice(hf), region, spec.hf_row_block(name, args),
                                lambda block, name=name: spec.hf_from_tensor(name, block, args))
            assert torch.equal(part, whole[region]), name


def test_hf_path_made_absolute_and_hf_on_finish_needs_a_final_checkpoint(tmp_path, monkeypatch):
    from accelrun.config.schema import CheckpointConfig

    save_tiny_hf(tmp_path / "m", "llama")
    monkeypatch.chdir(tmp_path)
    assert ModelConfig(hf="m").hf == str((tmp_path / "m").resolve())
    with pytest.raises(ValueError, match="hf_on_finish exports the final checkpoint"):
        CheckpointConfig(hf_on_finish=True, save_final=False)


def test_provenance_of_shape_keys_is_the_config_json_line(tmp_path):
    from accelrun.config import load_config
    from accelrun.config.resolve import explain_text

    save_tiny_hf(tmp_path, "llama3")
    lines = (tmp_path / "config.json").read_text().splitlines()
    with pytest.raises(ConfigError) as err:  # the recipe's seq_len is longer than the checkpoint's positions
        load_config("configs/llama.yaml", [f"model.hf={tmp_path}", "train.seq_len=128"])
    max_pos = next(i for i, line in enumerate(lines, 1) if '"max_position_embeddings"' in line)
    assert f"config.json:{max_pos} (max_position_embeddings)" in str(err.value)

    resolved = load_config("configs/llama.yaml", [f"model.hf={tmp_path}", "train.seq_len=32"])
    rows = {key: str(src) for key, _, src in resolved.explain()}
    hidden = next(i for i, line in enumerate(lines, 1) if '"hidden_size"' in line)
    assert rows["model.dim"].endswith(f"config.json:{hidden} (hidden_size)")
    assert rows["model.rope_scaling.factor"].endswith("(rope_parameters)")
    assert rows["model.hf"].startswith("override")
    assert "recipes/model/debug.yaml" not in "".join(v for k, v in rows.items() if k.startswith("model."))
    assert "(hidden_size)" in explain_text(resolved)
    # A Mistral's positions are its sliding window where that is shorter: the error names that line
    # (a new user read "max_position_embeddings" beside the window's 48).
    mistral = tmp_path / "mistral"
    save_tiny_hf(mistral, "mistral")
    lines = (mistral / "config.json").read_text().splitlines()
    window = next(i for i, line in enumerate(lines, 1) if '"sliding_window"' in line)
    with pytest.raises(ConfigError, match=rf"model.max_seq_len = 48 \(.*config.json:{window} \(sliding_window\)\)"):
        load_config("configs/llama.yaml", [f"model.hf={mistral}", "train.seq_len=64"])


def test_model_hf_typos_missing_folders_and_replaced_overrides(tmp_path):
    from accelrun.config import load_config

    save_tiny_hf(tmp_path, "llama")
    # A misspelt model key is the error, not the recipe's model.hf folder that does not exist here.
    with pytest.raises(ConfigError, match=r"unknown key 'model\.hff'; did you mean 'model\.hf'"):
        load_config("configs/hf-llama.yaml", [f"model.hff={tmp_path}"])
    # A missing folder names where model.hf was set.
    with pytest.raises(ConfigError, match=r"no such folder \(a local transformers folder.*models/my-chat-model\) \(model\.hf: configs/hf-llama\.yaml:\d+\)"):
        load_config("configs/hf-llama.yaml", ["data.tokenizer=byte"])
    with pytest.raises(ConfigError, match=r"config\.json': a file, not a folder \(give the folder holding"):
        load_config("configs/hf-llama.yaml", [f"model.hf={tmp_path / 'config.json'}", "data.tokenizer=byte"])
    # A command-line shape key the folder replaces is a warning naming the config.json line.
    resolved = load_config("configs/llama.yaml", [f"model.hf={tmp_path}", "train.seq_len=32", "model.dim=32",
                                                  f"model.n_layers={ModelConfig(hf=str(tmp_path)).n_layers}"])
    dim = ModelConfig(hf=str(tmp_path)).dim
    assert [w for w in resolved.warnings if "model.hf" in w] == [
        f"model.dim = 32 (override 'model.dim=32') has no effect: model.hf's "
        f"{tmp_path / 'config.json'}:{_line_of(tmp_path, 'hidden_size')} (hidden_size) sets {dim}"]


def _line_of(folder, key):
    lines = (folder / "config.json").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if f'"{key}"' in line)


def test_fsdp_x_tp_ranks_read_only_their_rows_of_each_tensor(tmp_path, monkeypatch):
    # Every rank of a fake 2 x 2 (dp_shard x tp) mesh builds the real layout, loads the folder, and holds
    # exactly its slice of transformers' weights; no rank reads a whole sharded tensor (FSDP x TP's
    # strided row shards included).
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from accelrun.config import load_config
    from accelrun.dist.context import ParallelContext
    from accelrun.dist.layout import apply_layout
    from accelrun.dist.mesh import build_mesh, dp_coordinates
    from accelrun.models import build_model, hf_io
    from accelrun.models.families import get_family

    hf = save_tiny_hf(tmp_path / "m", "llama")
    cfg = load_config("configs/llama.yaml", [f"model.hf={tmp_path / 'm'}", "train.seq_len=32",
                                             "parallel.nproc_per_node=4", "parallel.dp_shard=2", "parallel.tp=2"]).config
    spec = get_family("llama")
    args = spec.args_from_config(cfg.model)
    whole = spec.state_dict_from_hf(hf.state_dict(), args)  # accelrun's names and layout
    local_region, whole_reads = hf_io._local_region, []

    def spy(p):
        region = local_region(p)
        if region is None:
            whole_reads.append(p)
        return region

    monkeypatch.setattr(hf_io, "_local_region", spy)
    strided = 0
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            mesh = build_mesh(cfg.parallel, "cpu", 4)
            dp_rank, dp_size = dp_coordinates(mesh)
            ctx = ParallelContext(rank=rank, world_size=4, local_rank=rank, device=torch.device("cpu"), mesh=mesh,
                                  dp_rank=dp_rank, dp_size=dp_size, tp_size=2)
            model = build_model(cfg.model, torch.device("meta"))
            apply_layout(model, cfg, ctx, tmp_path / "dump")
            model.to_empty(device="cpu")
            hf_io.load_hf_for_config([model], cfg.model)
            for name, p in model.named_parameters():
                assert isinstance(p, DTensor), name
                strided += any("Strided" in type(pl).__name__ for pl in p.placements)
                assert torch.equal(p.to_local(), whole[name][local_region(p)]), (rank, name)
        finally:
            dist.destroy_process_group()
    assert strided > 0 and not whole_reads


def test_exported_weights_are_readable_as_the_umask_allows(tmp_path):
    # safetensors writes 0600: an export a serving job or a colleague could not read.
    import os

    from accelrun.models.families import get_family
    from accelrun.models.hf_io import export_hf

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, ffn_dim=64)
    spec = get_family("llama")
    model = build_model(cfg, "cpu", seed=0)
    old = os.umask(0o022)
    try:
        written = export_hf(model.state_dict(), spec, spec.args_from_config(cfg), tmp_path / "hf")
    finally:
        os.umask(old)
    weights = [p for p in written if p.suffix == ".safetensors"]
    assert weights and all(p.stat().st_mode & 0o777 == 0o644 for p in weights)


def test_an_export_over_an_earlier_one_leaves_none_of_its_weight_files(tmp_path):
    """A sharded export into a folder that held a one-file export (and the other way round): transformers
    reads a lone model.safetensors before an index, so the old file would be the model it loads."""
    from safetensors.torch import load_file

    from accelrun.models.families import get_family
    from accelrun.models.hf_io import export_hf

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, ffn_dim=64)
    spec = get_family("llama")
    sd = build_model(cfg, "cpu", seed=0).state_dict()
    out = tmp_path / "hf"
    export_hf(sd, spec, spec.args_from_config(cfg), out)  # one file
    (out / "notes.txt").write_text("mine")  # not a weight file: left alone
    removed: list = []
    written = export_hf(sd, spec, spec.args_from_config(cfg), out, max_shard_bytes=4_000, removed=removed)
    assert removed == [out / "model.safetensors"] and not (out / "model.safetensors").exists()
    assert (out / "notes.txt").exists() and len([p for p in written if p.suffix == ".safetensors"]) > 2
    removed = []
    export_hf(sd, spec, spec.args_from_config(cfg), out, removed=removed)  # back to one file
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"], removed
    assert set(load_file(out / "model.safetensors")) == set(spec.state_dict_to_hf(sd, spec.args_from_config(cfg)))


def test_an_export_keeps_the_sources_position_count_where_its_config_leaves_it_out(tmp_path):
    """A Mistral trained from a config.json without max_position_embeddings read 131,072 (transformers'
    default) clamped to its window; its export wrote the window (a review's)."""
    from accelrun.train.export import _carry_source_folder

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "mistral", "max_position_embeddings": 4096}))
    _carry_source_folder(tmp_path, {"model_type": "mistral", "sliding_window": 4096}, out, own_tokenizer=False)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 131072

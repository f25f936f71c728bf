import pytest
import torch

from accelrun.config.schema import DataConfig
from accelrun.data import DataError, SyntheticStream, build_data, load_stream


def test_builtin_default_source():
    it = build_data(DataConfig(max_bytes=1 << 20), seq_len=64, micro_batch=4, seed=0, vocab_size=512)
    b = next(it)
    assert b.inputs.shape == (4, 64) and int(b.inputs.max()) < 258
    assert it.state_dict()["fingerprint"] == it.stream.fingerprint["sha256"]


def test_vocab_too_small_for_the_byte_tokenizer():
    with pytest.raises(DataError, match=r"model\.vocab_size is 200.*258"):
        build_data(DataConfig(max_bytes=1 << 20), seq_len=64, micro_batch=4, seed=0, vocab_size=200)


def test_synthetic_uses_model_vocab_and_seed():
    cfg = DataConfig(source="synthetic")
    a = build_data(cfg, seq_len=32, micro_batch=2, seed=1, vocab_size=16, min_tokens=3 << 20)
    assert isinstance(a.stream, SyntheticStream) and len(a.stream) == 4 << 20
    x = next(a).inputs
    assert int(x.max()) < 16
    b = build_data(cfg, seq_len=32, micro_batch=2, seed=1, vocab_size=16, min_tokens=3 << 20)
    assert torch.equal(next(b).inputs, x)
    c = build_data(cfg, seq_len=32, micro_batch=2, seed=2, vocab_size=16, min_tokens=3 << 20)
    assert not torch.equal(next(c).inputs, x)


def test_data_seed_overrides_train_seed():
    cfg = DataConfig(source="synthetic", seed=7)
    a = build_data(cfg, seq_len=32, micro_batch=2, seed=1, vocab_size=16)
    b = build_data(cfg, seq_len=32, micro_batch=2, seed=2, vocab_size=16)
    assert a.seed == b.seed == 7
    assert torch.equal(next(a).inputs, next(b).inputs)


def test_short_text_names_found_and_needed(tmp_path):
    (tmp_path / "tiny.txt").write_text("x" * 100)
    cfg = DataConfig(source="text", paths=[str(tmp_path / "*.txt")])
    with pytest.raises(DataError, match=r"found 101 tokens, need at least 1025"):
        build_data(cfg, seq_len=64, micro_batch=8, seed=0, vocab_size=512, dp_size=2)
    it = build_data(cfg, seq_len=16, micro_batch=3, seed=0, vocab_size=512, dp_rank=1, dp_size=2)
    assert next(it).inputs.shape == (3, 16)


def test_text_without_paths():
    with pytest.raises(DataError, match=r"data\.paths is empty"):
        load_stream(DataConfig(source="text"), vocab_size=512, seed=0)

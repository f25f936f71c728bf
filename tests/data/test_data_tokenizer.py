import pytest
import torch

from accelrun.data import ByteTokenizer, DataError, get_tokenizer


def test_vocab_and_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 258
    assert (tok.BOS, tok.EOS) == (256, 257)


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓ 🚀", "line\nbreak\ttab\0nul"])
def test_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.BOS and ids[-1] == tok.EOS
    assert all(0 <= i < 256 for i in ids[1:-1])
    assert tok.decode(ids) == text
    t = tok.encode_tensor(text, bos=True, eos=True)
    assert t.dtype == torch.int64 and t.tolist() == ids
    assert tok.decode(t) == text


def test_encode_bytes_and_dtype():
    tok = ByteTokenizer()
    data = bytes(range(256))
    assert tok.encode(data) == list(range(256))
    t = tok.encode_tensor(data, dtype=torch.int32)
    assert t.dtype == torch.int32 and t.tolist() == list(range(256))
    assert tok.encode_tensor(memoryview(b"ab")).tolist() == [97, 98]


def test_decode_skips_out_of_range_and_replaces_bad_utf8():
    tok = ByteTokenizer()
    assert tok.decode([104, 256, 105, 257, 300, 511]) == "hi"
    assert tok.decode(torch.tensor([[104, 300], [105, 257]])) == "hi"
    assert tok.decode([0xFF, 104]) == "\ufffdh"


def test_unknown_tokenizer():
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match="data.tokenizer"):
        get_tokenizer("gpt2")

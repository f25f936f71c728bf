import hashlib
import os
from pathlib import Path

import pytest
import torch

from accelrun.config.schema import DataConfig
from accelrun.data import (
    ByteTokenizer,
    DataError,
    TokenFileHeader,
    build_data,
    load_text,
    load_tokens,
    open_tokens,
    prepare_tokens,
    read_header,
)
from accelrun.data.tokfile import HEADER_SIZE


@pytest.fixture()
def corpus(tmp_path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("first document ✓\n" * 50)
    (root / "sub" / "b.txt").write_text("second one\n" * 80)
    (root / "empty.txt").write_text("")
    return root


def test_prepare_and_memmap_round_trip(corpus, tmp_path):
    calls = []
    out = tmp_path / "out" / "corpus.tok"
    summary = prepare_tokens([str(corpus / "**" / "*.txt")], out, progress=lambda d, t: calls.append((d, t)))
    text = load_text([str(corpus / "**" / "*.txt")], max_bytes=None)
    assert summary["tokens"] == len(text) and summary["files"] == 2
    assert summary["bytes"] == text.fingerprint["bytes"]
    assert summary["tokenizer"] == "byte" and summary["vocab_size"] == 258 and summary["token_bytes"] == 2
    assert calls and calls[-1] == (summary["bytes"], summary["bytes"])
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    # no temporary file left behind; the document index sits beside the tokens
    assert sorted(os.listdir(out.parent)) == ["corpus.docs", "corpus.tok"]

    header, tokens = open_tokens(out, verify=True)
    assert header.n_tokens == len(text) and tokens.dtype == torch.uint16
    assert torch.equal(tokens.to(torch.int64), text.read(0, len(text)))
    assert os.path.getsize(out) == HEADER_SIZE + 2 * len(text)
    stream = load_tokens([str(out)])
    assert stream.fingerprint["tokens"] == len(text) and stream.fingerprint["sha256"]
    assert stream.document_starts.tolist() == text.document_starts.tolist() == [0, len("first document ✓\n".encode()) * 50 + 1]
    assert ByteTokenizer().decode(stream.read(0, 18)) == "first document ✓"  # ✓ is 3 bytes


def test_prepare_in_small_chunks_matches(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr("accelrun.data.prepare._WRITE_CHUNK", 100)  # files split across chunks
    out = tmp_path / "small.tok"
    prepare_tokens([str(corpus / "**" / "*.txt")], out, max_bytes=1000)
    text = load_text([str(corpus / "**" / "*.txt")], max_bytes=1000)
    _, tokens = open_tokens(out, verify=True)
    assert torch.equal(tokens.to(torch.int64), text.read(0, len(text)))


def test_several_token_files_read_as_one_stream(corpus, tmp_path):
    a = prepare_tokens([str(corpus / "a.txt")], tmp_path / "t" / "a.tok")
    b = prepare_tokens([str(corpus / "sub" / "b.txt")], tmp_path / "t" / "b.tok")
    stream = load_tokens([str(tmp_path / "t" / "*.tok")])
    assert len(stream) == a["tokens"] + b["tokens"]
    whole = load_text([str(corpus / "a.txt"), str(corpus / "sub" / "b.txt")], max_bytes=None)
    assert torch.equal(stream.read(0, len(stream)), whole.read(0, len(whole)))
    edge = a["tokens"]
    assert torch.equal(stream.read(edge - 5, edge + 5), whole.read(edge - 5, edge + 5))


def test_header_errors(corpus, tmp_path):
    good = tmp_path / "good.tok"
    prepare_tokens([str(corpus / "a.txt")], good)
    data = good.read_bytes()

    bad = tmp_path / "bad.tok"
    bad.write_bytes(b"NOTTOKEN" + data[8:])
    with pytest.raises(DataError, match="not an accelrun token file"):
        open_tokens(bad)
    bad.write_bytes(b"ACCTOK99" + data[8:])
    with pytest.raises(DataError, match="version"):
        open_tokens(bad)
    bad.write_bytes(data[:-3])
    with pytest.raises(DataError, match="truncated token file.*declares"):
        open_tokens(bad)
    bad.write_bytes(data[:40])
    with pytest.raises(DataError, match="truncated token file: 40 bytes"):
        read_header(bad)
    bad.write_bytes(b"")
    with pytest.raises(DataError, match="empty file"):
        open_tokens(bad)
    flipped = bytearray(data)
    flipped[-10] ^= 1
    bad.write_bytes(bytes(flipped))
    open_tokens(bad)  # the hash is only checked on request
    with pytest.raises(DataError, match="sha256"):
        open_tokens(bad, verify=True)


def test_vocab_mismatch_names_model_vocab_size(corpus, tmp_path):
    out = tmp_path / "c.tok"
    prepare_tokens([str(corpus / "**" / "*.txt")], out)
    cfg = DataConfig(source="tokens", paths=[str(out)])
    with pytest.raises(DataError, match=r"model\.vocab_size is 200.*at least 258"):
        build_data(cfg, seq_len=8, micro_batch=2, seed=0, vocab_size=200)
    it = build_data(cfg, seq_len=8, micro_batch=2, seed=0, vocab_size=258)
    assert next(it).inputs.shape == (2, 8)


def test_prepare_errors_and_skips_its_own_output(corpus, tmp_path):
    with pytest.raises(DataError, match="inputs.*matched no files"):
        prepare_tokens([str(tmp_path / "missing*.txt")], tmp_path / "x.tok")
    with pytest.raises(DataError, match="data.tokenizer"):
        prepare_tokens([str(corpus / "a.txt")], tmp_path / "x.tok", tokenizer="gpt2")
    out = corpus / "out.tok"
    first = prepare_tokens([str(corpus / "**" / "*")], out)
    again = prepare_tokens([str(corpus / "**" / "*")], out)
    assert again["tokens"] == first["tokens"] and again["sha256"] == first["sha256"]


def test_uint32_token_files_load(tmp_path):
    ids = torch.tensor([0, 70_000, 5, 99_999], dtype=torch.int64)
    payload = bytearray(4 * len(ids))
    torch.frombuffer(payload, dtype=torch.int32).copy_(ids)
    digest = hashlib.sha256(payload).hexdigest()
    header = TokenFileHeader(4, 100_000, len(ids), "bpe-100k", digest)
    path = tmp_path / "wide.tok"
    path.write_bytes(header.pack() + bytes(payload))
    assert read_header(path) == header
    got, tokens = open_tokens(path, verify=True)
    assert tokens.dtype == torch.uint32 and torch.equal(tokens.to(torch.int64), ids)
    stream = load_tokens([str(path)])
    assert stream.vocab_size == 100_000 and torch.equal(stream.read(1, 3), ids[1:3])


def _map_flags(address: int) -> list[str] | None:
    """The kernel's VmFlags of the mapping that holds ``address`` (None where smaps does not say)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):  # a map's header line ("lo-hi perms ..."), then its fields, then VmFlags
        span = line.split(maxsplit=1)[0]
        if ":" in span or "-" not in span:
            continue
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            flags = next((m for m in lines[i + 1:] if m.startswith("VmFlags:") or "-" in m.split()[0]), "")
            return flags.split()[1:] if flags.startswith("VmFlags:") else None
    return None


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the kernel's flags of the map (Linux)")
def test_token_maps_are_advised_random_when_windows_are_shuffled(corpus, tmp_path):
    """The loader reads shuffled windows: a token file's map carries MADV_RANDOM (the kernel's `rr` flag), so a
    page fault on a corpus larger than memory reads that page, not the device's whole read-ahead around it;
    a reader in order (data.shuffle = false) keeps read-ahead."""
    out = tmp_path / "c.tok"
    prepare_tokens([str(corpus / "**" / "*.txt")], out)
    _, shuffled = open_tokens(out, verify=True)  # verification reads the file in order first
    _, in_order = open_tokens(out, random_access=False)
    flags = _map_flags(shuffled.data_ptr())
    if flags is None:
        pytest.skip("this kernel's smaps has no VmFlags")
    assert "rr" in flags, flags
    assert "rr" not in (_map_flags(in_order.data_ptr()) or []), _map_flags(in_order.data_ptr())

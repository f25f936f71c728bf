import os
import sysconfig
from pathlib import Path

import pytest
import torch

from accelrun.data import (
    ByteTokenizer,
    DataError,
    SyntheticStream,
    expand_paths,
    load_builtin,
    load_text,
    read_documents,
    stdlib_files,
    synthetic_length,
)

MiB = 1 << 20


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_builtin_loads_deterministically():
    a = load_builtin("python-stdlib", max_bytes=MiB)
    b = load_builtin("python-stdlib", max_bytes=MiB)
    assert a.fingerprint == b.fingerprint
    assert torch.equal(a.tokens, b.tokens)
    fp = a.fingerprint
    assert fp["source"] == "builtin" and fp["bytes"] == MiB
    assert fp["tokens"] == len(a) == MiB + fp["files"]
    assert a.tokens.dtype == torch.uint16
    eos = (a.read(0, len(a)) == ByteTokenizer.EOS).sum().item()
    assert eos == fp["files"] and a.read(len(a) - 1, len(a)).item() == ByteTokenizer.EOS
    assert "import" in ByteTokenizer().decode(a.read(0, 20000))


def test_builtin_file_selection():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert "os.py" in rel
    assert not any(part in ("site-packages", "test", "tests") for r in rel for part in r.split("/"))
    with pytest.raises(DataError, match="data.builtin"):
        load_builtin("nope", max_bytes=MiB)


def test_text_globs_sorted_and_deduplicated(tmp_path):
    write(tmp_path / "b.txt", "bbb")
    write(tmp_path / "a.txt", "aa")
    write(tmp_path / "sub" / "deep" / "c.txt", "c")
    write(tmp_path / "skip.md", "no")
    files = expand_paths([str(tmp_path / "*.txt"), str(tmp_path / "**" / "*.txt"), str(tmp_path / "a.txt")])
    assert [f.name for f in files] == ["a.txt", "b.txt", "c.txt"]
    stream = load_text([str(tmp_path / "**" / "*.txt")], max_bytes=None)
    assert ByteTokenizer().decode(stream.read(0, len(stream))) == "aabbbc"
    assert stream.read(0, len(stream)).tolist().count(ByteTokenizer.EOS) == 3
    assert stream.fingerprint["files"] == 3 and stream.fingerprint["bytes"] == 6


def test_text_pattern_without_match_is_an_error(tmp_path):
    write(tmp_path / "a.txt", "x")
    missing = str(tmp_path / "nothing-*.txt")
    with pytest.raises(DataError, match=r"data\.paths.*nothing-\*\.txt.*matched no files"):
        load_text([str(tmp_path / "a.txt"), missing], max_bytes=None)
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match="only directories"):
        expand_paths([str(tmp_path / "dir")])
    with pytest.raises(DataError, match="empty"):
        expand_paths([])


def test_text_max_bytes_and_content_fingerprint(tmp_path):
    write(tmp_path / "one" / "a.txt", "hello")
    write(tmp_path / "one" / "b.txt", "world")
    write(tmp_path / "two" / "a.txt", "hello")
    write(tmp_path / "two" / "b.txt", "world")
    one = load_text([str(tmp_path / "one" / "*")], max_bytes=None)
    two = load_text([str(tmp_path / "two" / "*")], max_bytes=None)
    assert one.fingerprint["sha256"] == two.fingerprint["sha256"]  # content, not paths
    write(tmp_path / "two" / "b.txt", "worle")
    assert load_text([str(tmp_path / "two" / "*")], max_bytes=None).fingerprint != one.fingerprint
    cut = load_text([str(tmp_path / "one" / "*")], max_bytes=7)
    assert ByteTokenizer().decode(cut.read(0, len(cut))) == "hellowo"
    assert cut.fingerprint["bytes"] == 7 and len(cut) == 9


def test_an_edit_keeping_size_and_mtime_is_encoded_afresh(tmp_path):
    # The encoded-text cache's key had each file's size and mtime only: `touch -r`, `cp -p` or a sync that
    # keeps times over a same-size edit trained on the old tokens (a trial's). The change time and inode
    # are in the key too; no user can set those.
    path = write(tmp_path / "a.txt", "hello world")
    first = load_text([str(path)], max_bytes=None)
    st = os.stat(path)
    path.write_text("jello world")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = load_text([str(path)], max_bytes=None)
    assert ByteTokenizer().decode(again.read(0, 5)) == "jello", ByteTokenizer().decode(first.read(0, 5))


def test_synthetic_is_deterministic_and_lazy():
    a = SyntheticStream(vocab_size=50, length=1 << 20, seed=3)
    b = SyntheticStream(vocab_size=50, length=1 << 20, seed=3)
    far = b.read(900_000, 901_000)  # b reads out of order first
    assert torch.equal(a.read(0, 10_000), b.read(0, 10_000))
    assert torch.equal(a.read(900_000, 901_000), far)
    assert torch.equal(a.read(4000, 4200), a.read(0, 10_000)[4000:4200])  # across a chunk edge
    x = a.read(0, 50_000)
    assert x.dtype == torch.int64 and x.min() >= 0 and x.max() < 50
    assert len(torch.unique(x)) == 50
    c = SyntheticStream(vocab_size=50, length=1 << 20, seed=4)
    assert not torch.equal(c.read(0, 1000), x[:1000])
    assert c.fingerprint["sha256"] != a.fingerprint["sha256"]
    assert a.fingerprint == b.fingerprint
    longer = SyntheticStream(vocab_size=50, length=1 << 21, seed=3)
    assert torch.equal(longer.read(0, 1000), x[:1000])  # tokens do not depend on the length


def test_synthetic_length():
    assert synthetic_length(10) == 1 << 20
    assert synthetic_length((1 << 21) + 1) == 1 << 22
    assert synthetic_length(1 << 21) == 1 << 21
    assert synthetic_length(None) >= 1 << 20


def test_unreadable_file_is_a_data_error(tmp_path):
    write(tmp_path / "a.txt", "x")
    link = tmp_path / "dangling.txt"
    link.symlink_to(tmp_path / "gone.txt")
    (tmp_path / "gone.txt").write_text("y")
    files = expand_paths([str(tmp_path / "*.txt")])
    (tmp_path / "gone.txt").unlink()
    with pytest.raises(DataError, match="cannot read"):
        read_documents(files, max_bytes=None, fingerprint={})

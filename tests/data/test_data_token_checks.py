"""Token files are checked before training on them: a payload that no longer matches its header's
sha256, or an id past the vocabulary, is one message and exit 2, not a crash inside the model."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.data import DataError, TokenFileHeader, open_tokens
from tests.conftest import DEFAULT_CONFIG, TINY


def write_tokens(path, ids: list[int], vocab: int) -> None:
    payload = bytearray(2 * len(ids))
    torch.frombuffer(payload, dtype=torch.int16).copy_(torch.tensor(ids, dtype=torch.int16))
    header = TokenFileHeader(2, vocab, len(ids), "byte", hashlib.sha256(payload).hexdigest())
    path.write_bytes(header.pack() + bytes(payload))


def test_an_id_past_the_headers_vocabulary_is_named(tmp_path):
    path = tmp_path / "t.tok"
    write_tokens(path, [1, 2, 300, 4], vocab=258)
    with pytest.raises(DataError, match=r"token 2 has id 300, not below the vocab_size 258"):
        open_tokens(path, verify=True)


def test_a_verified_file_that_changes_is_checked_again(tmp_path):
    path = tmp_path / "t.tok"
    write_tokens(path, list(range(200)), vocab=258)
    open_tokens(path, verify=True)  # verified, and remembered for this version of the file
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new version even on coarse clocks
    with pytest.raises(DataError, match="sha256 is .* the header records"):
        open_tokens(path, verify=True)


@pytest.mark.parametrize("damage", ["flipped byte", "id past the vocabulary"])
def test_train_on_a_bad_token_file_exits_2_with_one_message(damage, tmp_path):
    path = tmp_path / "t.tok"
    write_tokens(path, [i % 250 for i in range(4000)] if damage == "flipped byte" else [5] * 3999 + [400],
                 vocab=258)
    if damage == "flipped byte":
        data = bytearray(path.read_bytes())
        data[-100] ^= 1
        path.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["train", str(DEFAULT_CONFIG), *TINY, "train.steps=2", "data.source=tokens",
                                 f"data.paths=[{path}]", f"report.runs_dir={tmp_path / 'runs'}"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.output.count("error:") == 1, r.output
    assert ("sha256" if damage == "flipped byte" else "has id 400") in r.output

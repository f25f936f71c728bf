"""``accelrun data examples`` (accelrun/data/examples.py): the README's inputs, written here with nothing
downloaded. The same documents in every record format; a chat model folder that transformers loads, whose
chat template marks the assistant's tokens exactly as transformers' apply_chat_template does; a format a
missing package cannot write is skipped with the extra named."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from accelrun.data.chat import ChatEncoder, LossOn
from accelrun.data.examples import write_examples
from accelrun.data.records import iter_records

transformers = pytest.importorskip("transformers", reason="the chat model is checked against transformers")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("examples")
    report = write_examples(root)
    assert not report.skipped, report.skipped
    return root


def test_every_format_holds_the_same_documents(root):
    corpus = root / "corpus"
    texts = {}
    for name, column in [("docs.jsonl", "text"), ("docs.json", "text"), ("docs.csv", "body"),
                         ("docs.parquet", "text"), ("docs.arrow", "text"), ("saved", "text")]:
        texts[name] = [r.text(column, key="data.text_field") for r in iter_records([str(corpus / name)], [column])]
    assert len(texts["docs.jsonl"]) == 64 and all(texts["docs.jsonl"])
    assert all(t == texts["docs.jsonl"] for t in texts.values())


def test_the_chat_model_is_what_transformers_reads_and_marks(root):
    import torch

    folder = root / "models" / "my-chat-model"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size >= len(tok) and model.config.max_position_embeddings >= 128
    encoder = ChatEncoder.for_tokenizer(str(folder), LossOn.ASSISTANT)
    chats = [json.loads(line)["messages"] for line in (root / "chats.jsonl").read_text().splitlines()]
    assert len(chats) == 256 and all(any(m["role"] == "assistant" for m in c) for c in chats)
    for chat in chats[:8]:
        ref = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        got = encoder.encode(chat, where="test")
        assert got.ids == list(ref["input_ids"])
        assert [int(b) for b in got.loss_mask] == list(ref["assistant_masks"])
        assert 0 < sum(ref["assistant_masks"]) < len(got.ids)
    with torch.no_grad():  # the weights are finite: a forward pass gives a loss near log(vocab)
        ids = torch.tensor([got.ids])
        loss = model(ids, labels=ids).loss
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(float(model.config.vocab_size)))) < 1.0


def test_without_pyarrow_the_formats_it_writes_are_skipped_with_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "datasets", None)
    report = write_examples(tmp_path)
    skipped = {w.path: w.what for w in report.skipped}
    assert skipped["corpus/docs.parquet"] == skipped["corpus/docs.arrow"] == "pip install 'accelrun[data]' (pyarrow)"
    assert "datasets" in skipped["corpus/saved"]
    assert (tmp_path / "corpus" / "docs.jsonl").is_file() and not (tmp_path / "corpus" / "docs.parquet").exists()


def test_a_users_own_file_of_an_examples_name_is_not_replaced_without_force(tmp_path):
    """A trial's own corpus/a.txt and chats.jsonl were replaced without a word (`--help` said earlier
    copies are; the command could not tell its copies from a team's files)."""
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("MY PRECIOUS DATA")
    r = CliRunner().invoke(cli, ["data", "examples", "-C", str(tmp_path)])
    assert r.exit_code == 2 and "corpus/a.txt under" in r.output and "--force" in r.output, r.output
    assert (tmp_path / "corpus" / "a.txt").read_text() == "MY PRECIOUS DATA"
    assert CliRunner().invoke(cli, ["data", "examples", "-C", str(tmp_path), "--force"]).exit_code == 0
    assert CliRunner().invoke(cli, ["data", "examples", "-C", str(tmp_path)]).exit_code == 0  # its own copies: again
    (tmp_path / "chats.jsonl").write_text('{"messages": []}\n')  # an example edited since
    r = CliRunner().invoke(cli, ["data", "examples", "-C", str(tmp_path)])
    assert r.exit_code == 2 and "chats.jsonl under" in r.output, r.output

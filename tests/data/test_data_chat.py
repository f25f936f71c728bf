"""data.format: chat: rendering with the tokenizer folder's own chat template gives transformers'
``apply_chat_template`` text and ids, ``data.loss_on: assistant`` keeps exactly the tokens its
``return_assistant_tokens_mask`` marks, the mask reaches the loader's targets as -100, and bad chats
exit 2 with one line naming the record. Tokenizers are trained here (nothing downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from accelrun.config.schema import DataConfig
from accelrun.data import DataError, TokenBatchIterator, load_stream
from accelrun.data.chat import ChatEncoder, LossOn, assistant_token_mask, check_messages, check_parts_rendered
from accelrun.data.chat_template import CharSpan, ChatTemplate
from accelrun.data.loss_mask import IGNORE_INDEX
from tests.data.chat_helpers import (
    BLOCK_CHATS,
    BLOCKS_TEMPLATE,
    CHAT_TEMPLATE,
    CHATS,
    save_chat_tokenizer,
    write_chats,
)

transformers = pytest.importorskip("transformers", reason="the chat tests compare against transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    jinja = save_chat_tokenizer(root / "jinja")  # the template in chat_template.jinja (transformers' own way)
    in_config = root / "in-config"  # the older way: tokenizer_config.json's chat_template
    in_config.mkdir()
    (in_config / "tokenizer.json").write_text((jinja / "tokenizer.json").read_text())
    config = json.loads((jinja / "tokenizer_config.json").read_text())
    (in_config / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return {"jinja": jinja, "in-config": in_config, "none": save_chat_tokenizer(root / "none", template=None),
            "root": root}


def _reference(folder: Path, chat: list) -> tuple[list[int], list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    out = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("where", ["jinja", "in-config"])
def test_text_ids_and_assistant_mask_equal_transformers(folders, where):
    folder = folders[where]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    encoder = ChatEncoder.for_tokenizer(str(folder), LossOn.ASSISTANT)
    assert encoder.template.source.name == ("chat_template.jinja" if where == "jinja" else "tokenizer_config.json")
    marked = counted = 0
    for chat in CHATS:
        text, spans = encoder.template.render(chat)
        assert text == tok.apply_chat_template(chat, tokenize=False)
        assert len(spans) == sum(m["role"] == "assistant" for m in chat)
        ids, mask = _reference(folder, chat)
        got = encoder.encode(chat, where="test")
        assert got.ids == ids
        assert [int(b) for b in got.loss_mask] == mask
        marked += sum(mask)
        counted += sum(got.loss_mask)
    assert counted == marked > 0
    assert counted < sum(len(_reference(folder, c)[0]) for c in CHATS)  # the user's tokens are out


def test_another_template_style_equals_transformers_too(folders, tmp_path):
    folder = save_chat_tokenizer(tmp_path / "blocks", template=BLOCKS_TEMPLATE)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    encoder = ChatEncoder.for_tokenizer(str(folder), LossOn.ASSISTANT)
    for chat in BLOCK_CHATS:
        assert encoder.template.render(chat)[0] == tok.apply_chat_template(chat, tokenize=False)
        ids, mask = _reference(folder, chat)
        got = encoder.encode(chat, where="test")
        assert (got.ids, [int(b) for b in got.loss_mask]) == (ids, mask) and sum(mask) > 0


def test_special_tokens_named_only_in_special_tokens_map_json(folders, tmp_path):
    """Older folders name bos/eos in special_tokens_map.json; templates see them as transformers shows them."""
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in ("tokenizer.json", "chat_template.jinja"):
        (legacy / f).write_text((folders["jinja"] / f).read_text())
    config = json.loads((folders["jinja"] / "tokenizer_config.json").read_text())
    (legacy / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                              if k not in ("bos_token", "eos_token")}))
    (legacy / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = transformers.AutoTokenizer.from_pretrained(legacy)
    text = ChatTemplate.load(legacy).render(CHATS[0])[0]
    assert text == tok.apply_chat_template(CHATS[0], tokenize=False) and text.startswith("<s>")


def test_loss_on_all_keeps_every_token(folders):
    encoder = ChatEncoder.for_tokenizer(str(folders["jinja"]), LossOn.ALL)
    got = encoder.encode(CHATS[1], where="test")
    assert got.ids == _reference(folders["jinja"], CHATS[1])[0] and all(got.loss_mask)


def test_assistant_token_mask_counts_tokens_cut_by_a_span_edge():
    # Tokens [0,2) [2,5) [5,6) [6,9); span [3, 6): the token it starts inside counts, as transformers counts it.
    assert assistant_token_mask([(0, 2), (2, 5), (5, 6), (6, 9)], [CharSpan(3, 6)]) == [False, True, True, False]
    assert assistant_token_mask([(0, 1), (1, 2)], []) == [False, False]


def _chat_config(folder: Path, paths: list[str], **kw) -> DataConfig:
    return DataConfig(source="documents", format="chat", paths=paths, tokenizer=str(folder), shuffle=False, **kw)


@pytest.mark.parametrize("packing", ["concat", "document"])
def test_loader_targets_are_masked_exactly_where_the_assistant_did_not_speak(folders, tmp_path, packing):
    """Every target the loader leaves in the loss is a token transformers marks as the assistant's, and
    every marked token is one (document packing also masks each chat's first token: never the assistant's)."""
    chats = write_chats(tmp_path / "chats.jsonl", CHATS * 3)
    stream = load_stream(_chat_config(folders["jinja"], [str(chats)]), vocab_size=512, seed=0)
    ids, marks = [], []
    for chat in CHATS * 3:  # the stream is the chats one after another, nothing between them
        i, m = _reference(folders["jinja"], chat)
        ids += i
        marks += m
    assert stream.read(0, len(stream)).tolist() == ids
    assert stream.document_starts[1] == len(_reference(folders["jinja"], CHATS[0])[0])
    T = 16
    it = TokenBatchIterator(stream, seq_len=T, micro_batch=2, seed=0, shuffle=False, packing=packing)
    seen = 0
    for _ in range(it.batches_per_epoch):
        inputs_BT, targets_BT = next(it)[:2]
        for row in range(2):
            start = (seen + row) * T
            want = [t if marks[start + 1 + j] else IGNORE_INDEX for j, t in enumerate(ids[start + 1:start + T + 1])]
            assert targets_BT[row].tolist() == want
            assert inputs_BT[row].tolist() == ids[start:start + T]
        seen += 2
    covered = marks[1:seen * T + 1]
    assert 0 < sum(covered) < len(covered)


def test_fused_linear_cross_entropy_honours_the_mask_even_when_it_masks_everything():
    from accelrun.compile.fused import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 8, 16, generator=g)
    w = torch.randn(40, 16, generator=g)
    targets = torch.randint(0, 40, (3, 8), generator=g)
    targets[0] = IGNORE_INDEX  # a whole row (a user turn), split across the chunks
    targets[1, 2:7] = IGNORE_INDEX
    for t in (targets, torch.full_like(targets, IGNORE_INDEX)):
        hs, ws = [h.clone().requires_grad_() for _ in range(2)], [w.clone().requires_grad_() for _ in range(2)]
        eager = torch.nn.functional.cross_entropy((hs[0] @ ws[0].t()).flatten(0, 1), t.flatten())
        fused = linear_cross_entropy(hs[1], ws[1], None, t, chunk_rows=5)
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-6, equal_nan=True)
        (eager.nan_to_num() if t.ne(IGNORE_INDEX).any() else eager * 0).backward()
        (fused.nan_to_num() if t.ne(IGNORE_INDEX).any() else fused * 0).backward()
        torch.testing.assert_close(hs[1].grad, hs[0].grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ws[1].grad, ws[0].grad, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(hs[1].grad).all()


# --- bad input: one line, exit 2, naming the record or the tokenizer ----------------------------------


def _error(folder: Path, tmp_path: Path, chats: list, **kw) -> str:
    path = write_chats(tmp_path / "bad.jsonl", chats)
    with pytest.raises(DataError) as e:
        load_stream(_chat_config(folder, [str(path)], **kw), vocab_size=512, seed=0)
    assert e.value.exit_code == 2 and len(e.value.messages) == 1 and "\n" not in e.value.messages[0]
    return e.value.messages[0]


def test_a_chat_without_an_assistant_turn_names_its_line(folders, tmp_path):
    msg = _error(folders["jinja"], tmp_path, [CHATS[0], [{"role": "user", "content": "hello?"}]])
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:2: a chat with no assistant turn (roles: user)")
    assert "data.loss_on: all" in msg
    stream = load_stream(_chat_config(folders["jinja"], [str(tmp_path / "bad.jsonl")], loss_on="all"),
                         vocab_size=512, seed=0)
    assert stream.fingerprint["chats"] == 2  # loss_on: all trains on it


@pytest.mark.parametrize("messages, says", [
    ("just text", "should be a list of {role, content} messages, got str"),
    ([], "got an empty list"),
    ([{"role": "user", "text": "hi"}], "message 0 has keys 'role', 'text'"),
    ([{"role": "user", "content": "hi"}, "assistant: hello"], "message 1 has str"),
])  # fmt: skip
def test_messages_that_are_not_role_content_pairs(folders, tmp_path, messages, says):
    msg = _error(folders["jinja"], tmp_path, [CHATS[0], CHATS[1], messages])
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:3: data.messages_field 'messages'") and says in msg, msg


def test_content_as_a_list_of_parts_the_template_writes_as_python_text_is_refused(folders, tmp_path):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "yo"}]
    msg = _error(folders["jinja"], tmp_path, [CHATS[0], parts])
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:2: message 0's content is a list of parts ([{{'type': 'text'"), msg
    assert "give each content as a string" in msg
    # a null content (a tool call's) passes: check_messages drops the key
    check_parts_rendered(check_messages([{"role": "assistant", "content": None}], where="x", field="messages"), "",
                         where="x")


def test_the_templates_own_refusal_names_the_record(folders, tmp_path):
    msg = _error(folders["jinja"], tmp_path, [[{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]])
    assert msg.startswith(f"{tmp_path / 'bad.jsonl'}:1: the chat template") and "unknown role tool" in msg


def test_a_tokenizer_without_a_chat_template_is_named(folders, tmp_path):
    msg = _error(folders["none"], tmp_path, CHATS)
    assert f"data.tokenizer: the tokenizer in {folders['none']} has no chat template" in msg
    assert "chat_template.jinja" in msg and "data.format: text" in msg


def test_a_template_without_generation_blocks_cannot_say_what_the_assistant_wrote(folders, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_text((folders["jinja"] / "tokenizer.json").read_text())
    (plain / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""))
    msg = _error(plain, tmp_path, CHATS)
    assert "{% generation %}" in msg and str(plain / "chat_template.jinja") in msg and "data.loss_on: all" in msg
    assert ChatTemplate.load(plain).render(CHATS[0])[1] == []
    load_stream(_chat_config(plain, [str(tmp_path / "bad.jsonl")], loss_on="all"), vocab_size=512, seed=0)


def test_the_byte_tokenizer_has_no_chat_template(tmp_path):
    path = write_chats(tmp_path / "c.jsonl", CHATS)
    with pytest.raises(DataError, match="data.tokenizer = byte: data.format: chat renders messages"):
        load_stream(DataConfig(source="documents", format="chat", paths=[str(path)]), vocab_size=512, seed=0)


# --- through the command line: validation before any process starts, and the record's line at run time ----


@pytest.fixture(scope="module")
def hf_model(folders) -> Path:
    from tests.models.hf_helpers import save_tiny_hf

    folder = folders["root"] / "model"
    save_tiny_hf(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / f).write_text((folders["jinja"] / f).read_text())
    return folder


def _cli(*args: str):
    from click.testing import CliRunner

    from accelrun.cli.main import cli

    return CliRunner().invoke(cli, list(args))


def _recipe(model: Path, chats: Path, *more: str) -> list[str]:
    return [str(Path(__file__).parents[2] / "configs" / "hf-chat.yaml"), f"model.hf={model}",
            f"data.paths=[{chats}]", "train.seq_len=32", "train.global_batch=4", "train.device=cpu", *more]


def test_validate_refuses_a_chat_recipe_the_tokenizer_cannot_render(folders, hf_model, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", CHATS)
    ok = _cli("validate", *_recipe(hf_model, chats))
    assert ok.exit_code == 0 and "chats rendered with its chat template, the loss on assistant tokens" in ok.output
    for more, says in [
        ([f"data.tokenizer={folders['none']}"], f"the tokenizer in {folders['none']} has no chat template"),
        (["data.tokenizer=byte"], "data.tokenizer = byte (override 'data.tokenizer=byte'): data.format: chat renders"),
    ]:
        r = _cli("validate", *_recipe(hf_model, chats, *more))
        assert r.exit_code == 2 and says in " ".join(r.output.split()), r.output


def test_a_chat_model_without_a_tokenizer_is_never_told_to_use_byte(folders, tmp_path):
    """model.hf without a tokenizer: under data.format: chat the byte tokenizer cannot render a chat, so the
    error must not suggest data.tokenizer=byte (following it only gives the next exit 2); a text recipe
    still gets that suggestion."""
    from tests.models.hf_helpers import save_tiny_hf

    bare = tmp_path / "bare"
    save_tiny_hf(bare)  # config.json and weights, no tokenizer
    chats = write_chats(tmp_path / "chats.jsonl", CHATS)
    r = _cli("validate", *_recipe(bare, chats))
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "data.tokenizer" in said and "tokenizer with a chat template" in said, r.output
    assert "byte" not in said, r.output
    text = _cli("validate", *_recipe(bare, tmp_path / "chats.jsonl", "data.format=text", "data.text_field=messages"))
    assert text.exit_code == 2 and "data.tokenizer=byte trains on byte-level tokens" in text.output, text.output


def test_train_names_the_line_of_a_chat_without_an_assistant(hf_model, tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", [*CHATS, [{"role": "system", "content": "be brief"}]])
    r = _cli("train", *_recipe(hf_model, chats, f"report.runs_dir={tmp_path / 'runs'}", "compile.backend=eager"))
    assert r.exit_code == 2, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("error:"))
    assert line == (f"error: {chats}:4: a chat with no assistant turn (roles: system); data.loss_on: assistant "
                    "trains only on what the assistant says: drop the record, or set data.loss_on: all")


def test_chats_gathered_in_several_segments_read_as_one_stream(folders, tmp_path, monkeypatch):
    import accelrun.data.chat as chat

    chats = write_chats(tmp_path / "chats.jsonl", CHATS * 3)
    cfg = _chat_config(folders["jinja"], [str(chats)])
    whole = load_stream(cfg, vocab_size=512, seed=0)
    monkeypatch.setattr(chat, "CHATS_PER_SEGMENT", 2)
    cut = load_stream(cfg, vocab_size=512, seed=0)
    assert len(cut.segments) == 5 and len(whole.segments) == 1
    n = len(whole)
    assert torch.equal(cut.read(0, n), whole.read(0, n))
    assert torch.equal(cut.read_loss_mask(0, n), whole.read_loss_mask(0, n))
    assert torch.equal(cut.document_starts, whole.document_starts)
    assert cut.read_loss_mask(3, n - 2).sum() == whole.fingerprint["loss_tokens"] - whole.read_loss_mask(0, 3).sum() \
        - whole.read_loss_mask(n - 2, n).sum()

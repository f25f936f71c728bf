"""Chat records (``data.format: chat``) to tokens and a loss mask.

Each record's ``data.messages_field`` is a list of ``{role, content}`` messages. It is rendered with
the tokenizer folder's own chat template (``accelrun.data.chat_template``, as transformers renders
it) and the text encoded as ``apply_chat_template`` encodes it (the tokenizer without its own special
tokens: the template writes them). A chat is the template's rendering and nothing more: no end-of-text
is appended (the template ends a turn as the model expects).

The loss mask marks, per token, whether it is in the loss. ``data.loss_on: all``: every token.
``data.loss_on: assistant``: the tokens that overlap a ``{% generation %}`` block of the rendering, by
the rule ``apply_chat_template(..., return_assistant_tokens_mask=True)`` applies to the tokenizer's
character offsets, so the two count the same tokens.

>>> encoder = ChatEncoder.for_tokenizer("models/my-llama", LossOn.ASSISTANT)  # doctest: +SKIP
>>> chat = encoder.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
...                       where="chats.jsonl:1")
>>> chat.ids, chat.loss_mask
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch

from accelrun.config.chat_template_file import no_generation_blocks
from accelrun.data.chat_template import CharSpan, ChatTemplate
from accelrun.data.errors import DataError
from accelrun.data.hf_tokenizer import HFTokenizer
from accelrun.data.records import iter_records
from accelrun.data.stream import TensorStream, short_hash

ASSISTANT = "assistant"
CHATS_PER_SEGMENT = 4096


class LossOn(Enum):
    """``data.loss_on``: which tokens of a chat the loss counts."""

    ASSISTANT = "assistant"
    ALL = "all"


@dataclass(frozen=True)
class EncodedChat:
    ids: list[int]
    loss_mask: list[bool]  # per token of ids: True = in the loss (as the target of the token before it)


class ChatRecord(Protocol):
    """What the record readers (``accelrun.data.records``) give: a value per column, and where it is."""

    where: str

    def __getitem__(self, column: str) -> Any: ...


class ChatEncoder:
    """Renders and encodes chats with one tokenizer folder's template."""

    def __init__(self, tokenizer: HFTokenizer, template: ChatTemplate, loss_on: LossOn):
        if loss_on is LossOn.ASSISTANT and not template.marks_generation:
            raise DataError(no_generation_blocks(template))
        self.tokenizer, self.template, self.loss_on = tokenizer, template, loss_on

    @classmethod
    def for_tokenizer(cls, tokenizer: str | HFTokenizer, loss_on: LossOn, *, key: str = "data.tokenizer") -> ChatEncoder:
        """The encoder of a tokenizer folder (or a tokenizer.json inside one), its template from beside it."""
        if isinstance(tokenizer, str):
            if tokenizer == "byte":
                raise DataError(f"{key} = byte: data.format: chat renders messages with a Hugging Face tokenizer's "
                                "chat template; set data.tokenizer to the model's folder (hf, with model.hf)")
            tokenizer = HFTokenizer.load(tokenizer, key=key)
        return cls(tokenizer, ChatTemplate.load(Path(tokenizer.info.path).parent, key=key), loss_on)

    def encode(self, messages: Any, *, where: str, field: str = "messages") -> EncodedChat:
        """One chat's ids and loss mask; DataError naming ``where`` (``file:line``) for a bad chat."""
        messages = check_messages(messages, where=where, field=field)
        if self.loss_on is LossOn.ASSISTANT and not any(m["role"] == ASSISTANT for m in messages):
            roles = ", ".join(str(m["role"]) for m in messages)
            raise DataError(f"{where}: a chat with no assistant turn (roles: {roles}); data.loss_on: assistant trains "
                            "only on what the assistant says: drop the record, or set data.loss_on: all")
        try:
            text, spans = self.template.render(messages)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        check_parts_rendered(messages, text, where=where)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        if self.loss_on is LossOn.ALL:
            return EncodedChat(ids, [True] * len(ids))
        return EncodedChat(ids, assistant_token_mask(offsets, spans))


def check_messages(messages: Any, *, where: str, field: str) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts with a string role and a content, or one DataError line."""
    shape = "a list of {role, content} messages"
    if not isinstance(messages, list | tuple) or not messages:
        got = "an empty list" if isinstance(messages, list | tuple) else type(messages).__name__
        raise DataError(f"{where}: data.messages_field {field!r} should be {shape}, got {got}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            what = f"keys {', '.join(map(repr, m))}" if isinstance(m, dict) else type(m).__name__
            raise DataError(f"{where}: data.messages_field {field!r} should be {shape}; message {i} has {what}")
        # transformers drops keys whose value is None before rendering (templates test for a missing key).
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def check_parts_rendered(messages: Sequence[dict[str, Any]], text: str, *, where: str) -> None:
    """A message whose content is a list of parts (``[{"type": "text", "text": ...}]``, OpenAI's and
    transformers' multimodal format) rendered by a template that reads only strings comes out as that
    list's Python text, as transformers renders it too: the model would learn ``[{'type': 'text', ...``.
    One DataError line instead (a trial's chats trained so without a word)."""
    for i, m in enumerate(messages):
        content = m.get("content")  # (a null content, a tool call's, was dropped by check_messages)
        if isinstance(content, list | dict) and str(content) in text:
            raise DataError(f"{where}: message {i}'s content is a list of parts ({str(content)[:40]}...), and the "
                            "tokenizer's chat template writes it as Python text; give each content as a string "
                            "(the parts' text joined), or use a template that reads parts")


def assistant_token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[CharSpan]) -> list[bool]:
    """Per token: does its character range ``[start, end)`` overlap one of ``spans``? The rule of
    transformers' ``return_assistant_tokens_mask`` (a token split by a span's edge counts); spans and
    offsets both ascend, so one pass does."""
    mask = [False] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k].stop:
            k += 1
        if k == len(spans):
            break
        mask[i] = end > spans[k].start
    return mask


def encode_chat_records(records: Iterable[ChatRecord], encoder: ChatEncoder, *, field: str,
                        fingerprint: dict[str, Any]) -> TensorStream:
    """Every record's chat as one stream: tokens, a document index (one document per chat) and the loss
    mask. ``fingerprint`` is completed with the tokenizer, counts and a hash of tokens and mask.

    Chats are gathered into tensors ``CHATS_PER_SEGMENT`` at a time: a token costs its id's bytes and one
    byte of mask, not a Python int in a list."""
    token_dtype = encoder.tokenizer.token_dtype
    hasher = hashlib.sha256(f"{encoder.tokenizer.name}|{encoder.loss_on.value}|{encoder.template.text}".encode())
    segments: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    lengths: list[int] = []
    ids: list[int] = []
    keep: list[bool] = []

    def flush() -> None:
        if ids:
            segments.append(torch.tensor(ids, dtype=torch.int64).to(token_dtype))
            masks.append(torch.tensor(keep, dtype=torch.bool))
            hasher.update(segments[-1].view(torch.uint8).numpy().tobytes())
            hasher.update(masks[-1].numpy().tobytes())
            ids.clear()
            keep.clear()

    for record in records:
        chat = encoder.encode(record[field], where=record.where, field=field)
        if not chat.ids:
            continue
        lengths.append(len(chat.ids))
        ids += chat.ids
        keep += chat.loss_mask
        if len(lengths) % CHATS_PER_SEGMENT == 0:
            flush()
    flush()
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    hasher.update(lengths_t.numpy().tobytes())
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    done = dict(fingerprint, tokenizer=encoder.tokenizer.name, loss_on=encoder.loss_on.value, chats=len(lengths),
                tokens=int(lengths_t.sum()), loss_tokens=sum(int(m.sum()) for m in masks), sha256=short_hash(hasher))
    return TensorStream(segments, vocab_size=encoder.tokenizer.vocab_size, fingerprint=done, document_starts=starts,
                        loss_mask=masks)


def load_chat(paths: Sequence[str], encoder: ChatEncoder, *, messages_field: str) -> TensorStream:
    """``data.source: documents`` with ``data.format: chat``: the chats of the record files ``paths`` names."""
    records = iter_records(paths, [messages_field], column_key="data.messages_field")
    fingerprint = {"source": "documents", "format": "chat", "paths": list(paths), "messages_field": messages_field}
    return encode_chat_records(records, encoder, field=messages_field, fingerprint=fingerprint)

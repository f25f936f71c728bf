"""Where a Hugging Face tokenizer folder keeps its chat template, read without torch or jinja2.

transformers reads ``chat_template.jinja`` first and then ``tokenizer_config.json``'s ``chat_template``
(a string, or a list of ``{name, template}`` of which it renders ``default``). Validation reads it here
to refuse ``data.format: chat`` with a tokenizer that has none, and ``data.loss_on: assistant`` with a
template that does not mark the assistant's turns (``{% generation %}``), before any process starts;
the data layer (``accelrun.data.chat_template``) renders it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelrun.config.errors import ConfigError
from accelrun.config.tokenizer_file import BYTE, TokenizerFileError, resolve_model_hf, tokenizer_json_path

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
# The special tokens transformers passes to every template as variables (PreTrainedTokenizerBase's
# SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ConfigError):
    """A tokenizer folder without a usable chat template; the message names the folder or file."""


@dataclass(frozen=True)
class ChatTemplateFile:
    source: Path  # chat_template.jinja or tokenizer_config.json
    text: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks what the assistant says (``{% generation %}``)."""
        return GENERATION_TAG.search(self.text) is not None


def read_chat_template(folder: Path, *, key: str = "data.tokenizer") -> ChatTemplateFile:
    """The chat template of the tokenizer folder ``folder``, or ChatTemplateError saying what to do."""
    config = _read_config(folder / CONFIG_FILE, key)
    legacy = _read_config(folder / SPECIAL_TOKENS_FILE, key)  # older folders name their special tokens there
    special = {name: tok for name in SPECIAL_TOKEN_NAMES
               if (tok := _token_text(config.get(name)) or _token_text(legacy.get(name)))}
    jinja_file = folder / TEMPLATE_FILE
    if jinja_file.is_file():
        return ChatTemplateFile(jinja_file, _read_text(jinja_file, key), special)
    text = _default_template(config.get("chat_template"), folder / CONFIG_FILE, key)
    if text is None:
        raise ChatTemplateError(
            f"{key}: the tokenizer in {folder} has no chat template (no {TEMPLATE_FILE} and no chat_template in "
            f"{CONFIG_FILE}); data.format: chat renders messages with it: use the tokenizer of a chat model, "
            f"add a {TEMPLATE_FILE} to {folder}, or set data.format: text")
    return ChatTemplateFile(folder / CONFIG_FILE, text, special)


def no_generation_blocks(template: ChatTemplateFile) -> str:
    """The message for ``data.loss_on: assistant`` with a template that does not mark the assistant's turns."""
    return (f"data.loss_on: assistant needs to know which tokens the assistant wrote, but the chat template in "
            f"{template.source} has no {{% generation %}} ... {{% endgeneration %}} block around the assistant's "
            "turns; add one (as transformers' return_assistant_tokens_mask needs) or set data.loss_on: all")


def chat_problems(cfg: Any, v: Any) -> list[str]:
    """Validation of ``data.format: chat`` (``cfg`` a RunConfig; ``v("a.b")`` renders a key with where it was
    set): a tokenizer folder with a chat template, one that marks the assistant's turns under loss_on: assistant."""
    data = cfg.data
    if data.source != "documents" or data.format != "chat" or data.mix:
        return []
    if data.tokenizer == BYTE:
        return [f"{v('data.tokenizer')}: data.format: chat renders messages with a Hugging Face tokenizer's chat "
                "template; set data.tokenizer to the model's folder (hf, with model.hf)"]
    try:
        path = tokenizer_json_path(resolve_model_hf(data.tokenizer, cfg.model.hf, v("data.tokenizer")))
        template = read_chat_template(path.parent)
    except TokenizerFileError:
        return []  # tokenizer_problems reports it
    except ChatTemplateError as e:
        return [str(e)]
    if data.loss_on == "assistant" and not template.marks_generation:
        return [no_generation_blocks(template)]
    return []


def _read_text(path: Path, key: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{key}: cannot read {path}: {e}") from None


def _read_config(path: Path, key: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(_read_text(path, key))
    except ValueError as e:
        raise ChatTemplateError(f"{key}: {path} is not readable JSON: {e}") from None
    return config if isinstance(config, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older transformers wrote an AddedToken as a mapping
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _default_template(value: Any, path: Path, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(f"{key}: {path} has several chat templates ({', '.join(map(str, named))}) and none "
                                "named 'default'; accelrun renders the default one")
    raise ChatTemplateError(f"{key}: {path}: chat_template should be a string, got {type(value).__name__}")

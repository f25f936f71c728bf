"""A tokenizer folder with a chat template that marks the assistant's turns, and chat jsonl files, built
locally for the chat tests (nothing downloads)."""

from __future__ import annotations

import json
from pathlib import Path

# A ChatML-like template using what transformers gives templates: special-token variables, trim,
# raise_exception, namespace, loop controls, tojson and {% generation %} around the assistant's words.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}{% set ns.turns = ns.turns + 1 %}"
    "{% generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}\n"
    "{% elif message.get('meta') is not none %}{{ message['content'] | trim }} {{ message['meta'] | tojson }}\n"
    "{% else %}{{ message['content'] | trim }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}],
    [{"role": "system", "content": "You answer in haiku."},
     {"role": "user", "content": "Describe the sea <b>now</b>."},
     {"role": "assistant", "content": "Grey waves fold and break\nsalt wind over empty sand\nthe tide keeps its time"},
     {"role": "user", "content": "And the sky?", "meta": {"lang": "en", "tags": ["sky", "<x>"]}},
     {"role": "assistant", "content": "  Clouds drift east slowly, caf\u00e9 \u00fcber na\u00efve  "}],
    [{"role": "user", "content": "def f(x): return x * x\nwhat does f(3) give?"},
     {"role": "assistant", "content": "f(3) gives 9, since 3 * 3 = 9."},
     {"role": "user", "content": "and f(-2)?"},
     {"role": "assistant", "content": "4"}],
]


def save_chat_tokenizer(folder: Path, *, template: str | None = CHAT_TEMPLATE, vocab_size: int = 300) -> Path:
    """A byte-level BPE trained on CHATS, saved as transformers saves one, with ``template`` as its
    chat_template (None: no template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for chat in CHATS for m in chat] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


def write_chats(path: Path, chats: list, *, field: str = "messages") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: c}) + "\n" for c in chats))
    return path

# A second template in another house style (a default system turn, content that may be a list of text
# blocks, `is string` tests, a tools branch that must stay off, whitespace control, loop.last).
BLOCKS_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = 'You are helpful.' %}{%- set rest = messages %}"
    "{%- endif %}"
    "{{- '<|system|>\\n' + system }}{%- if tools is not none %}{{- '\\nTools: ' + tools | tojson }}{%- endif %}"
    "{{- eos_token + '\\n' }}"
    "{%- for message in rest %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | map(attribute='text') | join(' ') %}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' }}{% generation %}{{- text | trim + eos_token }}{% endgeneration %}"
    "{%- if not loop.last %}{{- '\\n' }}{%- endif %}"
    "{%- else %}{{- '<|' + message['role'] + '|>\\n' + text + eos_token + '\\n' }}{%- endif %}"
    "{%- endfor %}"
)
BLOCK_CHATS = [
    [{"role": "user", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "blocks."}]},
     {"role": "assistant", "content": "Seen both."}],
    [{"role": "system", "content": "Terse."}, {"role": "user", "content": "x?"},
     {"role": "assistant", "content": " y "}, {"role": "user", "content": "z?"},
     {"role": "assistant", "content": [{"type": "text", "text": "w"}]}],
]

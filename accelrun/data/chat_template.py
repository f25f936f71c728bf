"""A Hugging Face tokenizer folder's chat template, rendered as transformers renders it.

The template is the folder's ``chat_template.jinja`` or, failing that, the ``chat_template`` of its
``tokenizer_config.json`` (transformers reads them in that order; ``accelrun.config.chat_template_file``
finds it, so validation can too). It runs in jinja2's immutable
sandbox (chat templates come from model hubs: untrusted code) with the settings, filters and globals
transformers gives it, so the text is the text ``apply_chat_template`` makes:
``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``, a ``tojson``
that does not escape HTML, ``strftime_now``, ``dict``, ``namespace``, and the named special tokens
(``bos_token``, ``eos_token``, ...) as variables.

``{% generation %} ... {% endgeneration %}`` marks what the assistant says; rendering records the
character span of each such block, which ``accelrun.data.chat`` turns into the per-token loss mask.
transformers is not imported: it is a test dependency, and the tests compare against it.

>>> template = ChatTemplate.load(Path("models/my-llama"))  # doctest: +SKIP
>>> text, spans = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from accelrun.config.chat_template_file import GENERATION_TAG, ChatTemplateError, read_chat_template
from accelrun.data.errors import DataError, as_data_error

MIN_JINJA = (3, 1, 6)  # older releases have known sandbox escapes (transformers refuses them too)

# Where rendering records the assistant's spans: set only while ChatTemplate.render runs, so one
# compiled template serves any number of renders.
_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("chat_tracking", default=None)


@dataclass(frozen=True)
class CharSpan:
    """Characters ``[start, stop)`` of a rendered chat that a ``{% generation %}`` block produced."""

    start: int
    stop: int


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special-token variables it renders with."""

    source: Path  # the file the template came from (chat_template.jinja or tokenizer_config.json)
    text: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def marks_generation(self) -> bool:
        """Whether the template marks the assistant's text (``{% generation %}``): loss_on: assistant needs it."""
        return GENERATION_TAG.search(self.text) is not None

    @classmethod
    def load(cls, folder: Path, *, key: str = "data.tokenizer") -> ChatTemplate:
        """The chat template of the tokenizer folder ``folder``; DataError naming it when there is none."""
        with as_data_error(ChatTemplateError):
            found = read_chat_template(folder, key=key)
        return cls(found.source, found.text, found.special_tokens)

    @cached_property
    def _compiled(self):
        return _compile(self.text, str(self.source))

    def render(self, messages: list[dict[str, Any]], **variables: Any) -> tuple[str, list[CharSpan]]:
        """The chat as text, and the character spans of its ``{% generation %}`` blocks in order.

        A template that calls ``raise_exception`` (e.g. on roles out of order) raises DataError with
        its message; ``variables`` override the special tokens (as apply_chat_template's kwargs do)."""
        import jinja2

        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        context = {**self.special_tokens, "add_generation_prompt": False, "tools": None, "documents": None,
                   **variables, "messages": messages}
        token = _TRACKING.set((blocks, spans))
        try:
            for block in self._compiled.generate(**context):
                blocks.append(block)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"the chat template ({self.source}) refused a chat: {e}") from None
        finally:
            _TRACKING.reset(token)
        return "".join(blocks), [CharSpan(a, b) for a, b in spans]


def _compile(text: str, where: str):
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("data.format: chat needs jinja2 >= 3.1.6: pip install 'accelrun[hf]'") from None
    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < MIN_JINJA:
        raise DataError(f"data.format: chat needs jinja2 >= 3.1.6 (older releases let a template escape the sandbox),"
                        f" found {jinja2.__version__}: pip install -U 'jinja2>=3.1.6'")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(jinja2), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_namespace_class(jinja2))
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"data.tokenizer: the chat template in {where} is not valid jinja (line {e.lineno}: "
                        f"{e.message})") from None


def _generation_extension(jinja2):
    class GenerationSpans(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and records where it landed."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

        def _record(self, caller) -> str:
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(map(len, blocks))  # the body is emitted right after what is rendered so far
                spans.append((start, start + len(text)))
            return text

    return GenerationSpans


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & for HTML; chat templates want the JSON as it is.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without handing them the type itself (attribute walks out of the sandbox)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class(jinja2):
    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja's namespace, refusing underscore names (a way to reach CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    return TemplateNamespace

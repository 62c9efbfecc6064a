"""A checkpoint's Jinja chat template, rendered the way transformers' ``apply_chat_template`` renders it.

Same environment as transformers: Jinja2's ``ImmutableSandboxedEnvironment`` (a template is untrusted
code: no attribute escapes, no mutation of the inputs) with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block (rendered as its body), ``raise_exception``,
``strftime_now``, a ``tojson`` filter that does not escape HTML, and the variables ``messages``,
``add_generation_prompt``, ``tools`` / ``documents`` (None) and the special tokens by name
(``bos_token``, ``eos_token``, ...). The rendered text is encoded without adding special tokens (the
template writes its own), as ``apply_chat_template(..., tokenize=True)`` does.

Rendering is bounded (``cachecore.model.template_guard``): every loop item, call and lookup is
counted against a step budget, the clock against a time budget, and every string, list and the output
against a size cap; past any of them ``render`` raises ``RenderLimitExceeded`` (an ``InvalidPrompt``).

Like transformers' default, special-token text inside a message is parsed as that special token: a
tenant can shape the structure of its own prompt, never anyone else's (the cache key is the ids).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext

from cachecore.errors import InvalidPrompt
from cachecore.model.template_guard import GuardedEnvironment, RenderBudget, RenderLimitExceeded, render_bounded
from cachecore.model.tokenizer import ChatTemplate

TEMPLATE_NAME = "hf-jinja"
TEMPLATE_VERSION = 1


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """The compiled template; ``ValueError`` when it is not valid Jinja."""
    env = GuardedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from None


class JinjaChatTemplate:
    """``render(messages, add_generation_prompt=True) -> token ids`` and a ``digest`` for the namespace.

    ``tokenizer`` needs ``encode(text, add_bos=False)`` and ``digest``; ``special_tokens`` maps names
    (``bos_token``...) to their text. ``source`` None means the checkpoint has no chat template:
    ``render`` raises ``InvalidPrompt``. Messages are checked as ``ChatTemplate`` checks them (roles,
    string or text-part content, joined) and handed to the template as ``{"role", "content"}``.
    Template errors (``raise_exception``, sandbox violations, undefined operations) are
    ``InvalidPrompt`` too; a render past its ``RenderBudget`` (the default one when none is given) is
    ``RenderLimitExceeded``.
    """

    name = TEMPLATE_NAME
    version = TEMPLATE_VERSION

    def __init__(self, tokenizer, source: str | None, special_tokens: Mapping[str, str]) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = compile_template(source) if source is not None else None

    def render_text(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    budget: RenderBudget | None = None) -> str:
        if self._template is None:
            raise InvalidPrompt("this model has no chat template; use /v1/completions")
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
            raise InvalidPrompt("messages must be a non-empty list")
        chat = []
        for i, message in enumerate(messages):
            role, content = ChatTemplate._check(i, message)
            chat.append({"role": role, "content": content})
        context = {"messages": chat, "add_generation_prompt": add_generation_prompt, "tools": None,
                   "documents": None, **self.special_tokens}
        try:
            return render_bounded(self._template, context, budget or RenderBudget())
        except RenderLimitExceeded:
            raise
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidPrompt(f"chat template refused the messages: {exc}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, RecursionError) as exc:
            raise InvalidPrompt(f"chat template failed on the messages: {exc}") from None

    def render(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
               budget: RenderBudget | None = None) -> list[int]:
        return self.tokenizer.encode(self.render_text(messages, add_generation_prompt, budget), add_bos=False)

    @property
    def digest(self) -> str:
        """sha256 hex over the template source, the special tokens and the tokenizer digest."""
        blob = {"name": self.name, "version": self.version, "source": self.source,
                "special_tokens": self.special_tokens, "tokenizer": self.tokenizer.digest}
        return hashlib.sha256(json.dumps(blob, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

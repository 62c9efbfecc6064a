"""A Messages API request as the chat completions path serves it: the chat (``chat_messages``), the
OpenAI body (``chat_request``) and the prompt's tokens with where each ``cache_control`` breakpoint
ends in them (``render``).

Text blocks of one message are joined with a newline (as vLLM joins text parts); ``system`` becomes
the first message. A conversation that ends with an assistant message is continued: its text follows
the generation prompt, as Anthropic's prefill does.

A breakpoint ends where its block ends in the rendered prompt: the chat up to that block is rendered
without a generation prompt, and the breakpoint's position is the length of what it shares with the
whole prompt (so a template's end-of-turn tokens after a message's last block belong to it, and a
block in the middle of a message ends where its text does). A prefix the template refuses to render
on its own ends nowhere: served, never pinned (``too_short``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cachecore.errors import CacheError
from cachecore.model.template_guard import RenderBudget, RenderLimitExceeded
from controlplane.common.errors import TooLarge
from controlplane.serving.anthropic.schemas import MessagesRequest, TextBlock
from controlplane.serving.intake import BadRequest
from controlplane.serving.model_facts import ModelFacts

JOIN = "\n"


@dataclass(frozen=True)
class Breakpoint:
    """A ``cache_control`` mark: ``tokens``, the prompt's tokens up to the end of its block."""

    tokens: int
    ttl: str  # "5m" or "1h"
    ttl_seconds: int


@dataclass(frozen=True)
class Rendered:
    tokens: list[int]
    breakpoints: tuple[Breakpoint, ...]  # in prompt order


def _text(blocks: list[TextBlock]) -> str:
    return JOIN.join(b.text for b in blocks)


def _turns(body: MessagesRequest) -> list[tuple[str, list[TextBlock]]]:
    system = body.system_blocks()
    return ([("system", system)] if system else []) + [(m.role, m.blocks()) for m in body.messages]


def chat_messages(body: MessagesRequest) -> list[dict]:
    """The OpenAI chat messages of ``body`` (role and string content)."""
    return [{"role": role, "content": _text(blocks)} for role, blocks in _turns(body)]


def chat_request(body: MessagesRequest) -> dict:
    """The ``serving.schemas.ChatRequest`` fields of ``body``: what the chat path's quotas, worker
    request and accounting read."""
    out = {"model": body.model, "messages": chat_messages(body), "max_tokens": max(1, body.max_tokens),
           "temperature": body.temperature, "stream": body.stream, "stop": body.stop_sequences,
           "cache_salt": body.cache_salt, "cache_diagnostics": body.cache_diagnostics}
    if body.metadata is not None and body.metadata.user_id:
        out["user"] = body.metadata.user_id  # the router's stickiness key, as OpenAI's ``user``
    return out


def _guarded(fn: Callable[[], list[int]]) -> list[int]:
    try:
        return fn()
    except RenderLimitExceeded as exc:
        raise TooLarge(str(exc), code=exc.code) from None
    except CacheError as exc:
        raise BadRequest(str(exc), code=exc.code) from None


def prompt_of(facts: ModelFacts, chat: list[dict], budget: RenderBudget, *, open_end: bool = True) -> list[int]:
    """The tokens of ``chat``: with a generation prompt (``open_end``), and a final assistant message
    continued after it; without one (a prefix of a longer prompt) a final user message is closed as
    the template closes it."""
    def run() -> list[int]:
        if chat[-1]["role"] == "assistant" and len(chat) > 1:
            head = facts.chat.render(chat[:-1], add_generation_prompt=True, budget=budget)
            return head + facts.tokenizer.encode(chat[-1]["content"], add_bos=False)
        return facts.chat.render(chat, add_generation_prompt=open_end, budget=budget)

    return _guarded(run)


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def render(facts: ModelFacts, body: MessagesRequest, budget: RenderBudget) -> Rendered:
    """The prompt's tokens and its breakpoints (at most ``MAX_BREAKPOINTS``: one render each)."""
    turns = _turns(body)
    chat = chat_messages(body)
    tokens = prompt_of(facts, chat, budget)
    marks = []
    for i, (role, blocks) in enumerate(turns):
        for j, block in enumerate(blocks):
            if block.cache_control is None:
                continue
            partial = [*chat[:i], {"role": role, "content": _text(blocks[:j + 1])}]
            try:
                prefix = prompt_of(facts, partial, budget, open_end=False)
            except BadRequest:  # a template that renders no such prefix (a system message alone): not kept
                prefix = []
            marks.append(Breakpoint(tokens=_shared(tokens, prefix), ttl=block.cache_control.ttl,
                                    ttl_seconds=block.cache_control.seconds))
    return Rendered(tokens=tokens, breakpoints=tuple(marks))

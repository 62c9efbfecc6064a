"""The CPU-bound stages of a serving request, in the order that keeps each one's cost bounded by the last:

1. ``decode_body``: the body, at most the path's limit (``asgi_limits.body_limit``), to a JSON object;
2. ``serving.bounds`` checks on that object (prompt length, messages, content) against the model's
   context and the tenant's ``max_prompt_tokens``, before any per-item validation;
3. ``validate``: the pydantic schema;
4. ``tokenize``: chat template (``RenderBudget``: time, steps, and the characters a prompt within
   the bounds can have) and tokenizer.

``render`` runs 2-4. None of them touches the database: ``serving.context.prepare`` runs them in
``serving.render_pool``, between the database steps of the admission and of the quotas, except for a
small completion body (``context.INLINE_BODY``, no template to render), handled in the request's thread.
"""

from __future__ import annotations

import json

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest
from pydantic import BaseModel, ValidationError

from cachecore.errors import CacheError
from cachecore.model.template_guard import RenderBudget, RenderLimitExceeded
from controlplane.common.asgi_limits import body_limit, too_large_message
from controlplane.common.errors import ApplicationError, InvalidInput, TooLarge
from controlplane.serving import bounds
from controlplane.serving.model_facts import BYTE_CHAT, BYTE_TOKENIZER, ModelFacts


class BadRequest(ApplicationError):
    status = 400
    code = "invalid_request"


def decode_body(request: HttpRequest, limit: int | None = None) -> dict:
    """The JSON object of ``request``'s body. 413 over ``limit`` (the path's limit by default; the ASGI
    layer refused most such bodies before reading them), 400 for bytes that are not a UTF-8 JSON object."""
    limit = body_limit(request.path) if limit is None else limit
    try:
        body = request.body
    except RequestDataTooBig:
        body = None
    if body is None or len(body) > limit:
        raise TooLarge(too_large_message(limit))
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest("request body is not valid UTF-8", code="invalid_utf8") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc.msg} at position {exc.pos}",
                         code="invalid_json") from None
    except (ValueError, RecursionError):  # nesting too deep, integer literal too long
        raise BadRequest("request body is not acceptable JSON (too deeply nested or a number too long)",
                         code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return data


def validate(data: dict, schema: type[BaseModel]) -> BaseModel:
    """``data`` as ``schema``; 422 naming the first bad field."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidInput(f"{where}: {first.get('msg', 'invalid value')}", code="invalid_value") from None


def model_name(data: dict) -> str:
    """The ``model`` field, needed before the rest is validated (the bounds are the model's)."""
    name = data.get("model")
    if not isinstance(name, str) or not name:
        raise InvalidInput("model: a model name (a non-empty string) is required", code="invalid_value")
    return name


def render_budget(prompt: bounds.PromptBounds) -> RenderBudget:
    """A render may take ``STRATA_RENDER_BUDGET_MS`` and produce what a prompt within ``prompt`` can hold."""
    return RenderBudget(max_chars=max(prompt.chars, 1), seconds=settings.STRATA_RENDER_BUDGET_MS / 1000)


def tokenize(body: BaseModel, facts: ModelFacts | None = None, budget: RenderBudget | None = None) -> list[int]:
    """The prompt's token ids: the chat rendered (within ``budget``) or the string encoded. 400 for what
    the tokenizer or template refuses, 413 (naming the limit) for a render past its budget."""
    tokenizer, chat = (facts.tokenizer, facts.chat) if facts is not None else (BYTE_TOKENIZER, BYTE_CHAT)
    try:
        if hasattr(body, "messages"):
            return chat.render([m.model_dump() for m in body.messages], budget=budget)
        if isinstance(body.prompt, str):
            return tokenizer.encode(body.prompt)
        return list(body.prompt)
    except RenderLimitExceeded as exc:
        raise TooLarge(str(exc), code=exc.code) from None
    except CacheError as exc:
        raise BadRequest(str(exc), code=exc.code) from None


def render_messages(facts: ModelFacts, messages: list[dict], budget: RenderBudget | None = None) -> list[int]:
    """``messages`` rendered by the model's chat template (what ``tokenize`` does for a chat body)."""
    try:
        return facts.chat.render(messages, budget=budget)
    except RenderLimitExceeded as exc:
        raise TooLarge(str(exc), code=exc.code) from None
    except CacheError as exc:
        raise BadRequest(str(exc), code=exc.code) from None


def render(data: dict, schema: type[BaseModel], facts: ModelFacts, max_prompt_tokens: int | None
           ) -> tuple[BaseModel, list[int]]:
    """Bounds, validation and tokenization of a completion or chat body (stages 2-4)."""
    prompt = bounds.prompt_bounds(facts, max_prompt_tokens)
    if "messages" in schema.model_fields:
        bounds.check_messages(data, prompt)
    else:
        bounds.check_prompt(data, prompt)
    body = validate(data, schema)
    return body, tokenize(body, facts, render_budget(prompt))

"""The stages of ``POST /v1/responses`` around the worker call, each on the thread its work belongs on
(the views call them through ``render_pool`` and ``db_threads``):

- ``parse`` (render pool): the body within the admission's limit, the granted model, bounds, schema;
- ``previous`` (database): the stored response a turn continues (404 ``previous_response_not_found``
  alike for a missing, expired, shredded or another tenant's id) and room to store this one (429);
- ``render`` (render pool): the turn's prompt (``conversation.build``);
- ``context.prepare_rendered`` (database): quotas and the worker request, as for a chat;
- ``finish`` (after the worker): the response object, accounted (``views._account``) and stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.http import HttpRequest

from controlplane.common.errors import NotFound
from controlplane.conversations import selectors as stored
from controlplane.conversations import services as store
from controlplane.registry.models import ModelDeployment
from controlplane.serving import bounds, intake
from controlplane.serving.admission import Admission
from controlplane.serving.model_facts import ModelFacts, model_facts
from controlplane.serving.openai_responses import conversation, shapes
from controlplane.serving.openai_responses.schemas import DEFAULT_MAX_OUTPUT_TOKENS, ResponseCreate
from controlplane.serving.schemas import ChatRequest


@dataclass(frozen=True)
class Parsed:
    deployment: ModelDeployment
    facts: ModelFacts
    body: ResponseCreate


def parse(request: HttpRequest, admission: Admission) -> Parsed:
    data = intake.decode_body(request, admission.body_limit)
    deployment = admission.deployment(intake.model_name(data))
    facts = model_facts(deployment)
    conversation.check_bounds(data, bounds.prompt_bounds(facts, admission.tenant.max_prompt_tokens))
    return Parsed(deployment, facts, intake.validate(data, ResponseCreate))


def previous(tenant, body: ResponseCreate) -> dict | None:
    """The stored response ``body`` continues (None when it names none); 429 when ``body`` is to be
    stored and the tenant keeps all it may."""
    if body.store:
        store.check_room(tenant)
    if body.previous_response_id is None:
        return None
    found = stored.response_get(tenant, body.previous_response_id)
    if found is None:
        raise NotFound(f"previous response with id '{body.previous_response_id}' not found",
                       code="previous_response_not_found")
    return found


def render(parsed: Parsed, before: dict | None, max_prompt_tokens: int | None) -> conversation.Turn:
    """The turn's prompt. A previous turn of another model or template is continued as messages only."""
    budget = intake.render_budget(bounds.prompt_bounds(parsed.facts, max_prompt_tokens))
    splice = before is not None and before.get("template") == parsed.facts.chat.digest
    return conversation.build(parsed.facts, parsed.body, before, budget, splice=splice)


def chat_body(body: ResponseCreate, turn: conversation.Turn) -> ChatRequest:
    """The chat request this turn is served as (what ``context`` checks, limits and sends)."""
    head = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    return ChatRequest(model=body.model, messages=head + turn.messages,
                       max_tokens=body.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS,
                       temperature=1.0 if body.temperature is None else body.temperature,
                       stream=body.stream, cache_salt=body.cache_salt, prompt_cache_key=body.prompt_cache_key,
                       prompt_cache_retention=body.prompt_cache_retention, user=body.user or body.safety_identifier,
                       cache_diagnostics=body.cache_diagnostics)


def input_items(body: ResponseCreate) -> list[dict]:
    """This turn's input items as stored: ``{"id", "role", "content"}`` (text)."""
    return [{"id": item.id or shapes.new_item_id(), "role": item.role, "content": item.text()}
            for item in body.items()]


def store_turn(tenant, *, rid: str, parsed: Parsed, turn: conversation.Turn, prompt: list[int],
               generated: list[int], out: dict, text: str) -> None:
    """Keep the response (``out``) and what a later turn continues from, sealed, for the tenant's
    retention."""
    payload = {"response": out, "model": parsed.deployment.name, "template": parsed.facts.chat.digest,
               "instructions": parsed.body.instructions, "input_items": input_items(parsed.body),
               "messages": turn.messages, "output_text": text, "prompt_ids": list(prompt),
               "output_ids": conversation.output_ids(parsed.facts, generated)}
    store.response_store(tenant=tenant, public_id=rid, model=parsed.deployment.name, payload=payload,
                         tokens=len(prompt) + len(generated))

"""A ``POST /v1/messages`` request in a chat completion's stages (``serving.context.prepare``):

1. admission, by ``serving.gate`` before the body is read (the key from ``Authorization: Bearer`` or
   ``x-api-key``), else here on a serving database thread;
2. ``parse``, in the render pool (no database): the body within the admission's limit, its model among
   the granted ones, the chat bounds, the Messages schema, the chat rendered with its breakpoints
   (``translate.render``) and the OpenAI body the chat path reads (``translate.chat_request``);
3. the chat path's own last step (``context._finish``: vocabulary, tenant and context limits, tokens
   per minute, the worker request), whose job starts a whole answer's worker call (``EarlyCall``).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.http import HttpRequest

from controlplane.registry.models import ModelDeployment
from controlplane.serving import bounds, context, db_threads, intake, render_pool
from controlplane.serving.admission import Admission, admitted, gate_admission
from controlplane.serving.anthropic import translate
from controlplane.serving.anthropic.schemas import MessagesRequest
from controlplane.serving.early_call import EarlyCall
from controlplane.serving.model_facts import ModelFacts, model_facts
from controlplane.serving.schemas import ChatRequest


@dataclass(frozen=True)
class Parsed:
    deployment: ModelDeployment
    facts: ModelFacts
    body: MessagesRequest
    chat: ChatRequest
    rendered: translate.Rendered


def _bounded(data: dict) -> dict:
    """The body as ``bounds.check_messages`` reads a chat: the system text counts as a message."""
    system = data.get("system")
    messages = data.get("messages")
    if system is None or not isinstance(messages, list):
        return data
    return {"messages": [{"content": system}, *messages]}


def parse(request: HttpRequest, admission: Admission) -> Parsed:
    """Stage 2 (render pool; no database)."""
    tenant = admission.tenant
    data = intake.decode_body(request, admission.body_limit)
    deployment = admission.deployment(intake.model_name(data))
    facts = model_facts(deployment)
    prompt = bounds.prompt_bounds(facts, tenant.max_prompt_tokens)
    bounds.check_messages(_bounded(data), prompt)
    body = intake.validate(data, MessagesRequest)
    chat = intake.validate(translate.chat_request(body), ChatRequest)
    rendered = translate.render(facts, body, intake.render_budget(prompt))
    return Parsed(deployment=deployment, facts=facts, body=body, chat=chat, rendered=rendered)


def _finish(early: EarlyCall, tenant, parsed: Parsed, diagnostics: bool) -> context.Prepared:
    prep = context._finish(tenant, parsed.deployment, parsed.facts, parsed.chat, parsed.rendered.tokens,
                           diagnostics)
    early.start(prep)
    return prep


def wants_diagnostics(request: HttpRequest, body: MessagesRequest) -> bool:
    header = request.META.get(context.DIAGNOSTICS_HEADER, "").strip().lower()
    return body.cache_diagnostics or header in ("1", "true", "yes")


async def prepare(request: HttpRequest, early: EarlyCall) -> tuple[Admission, Parsed, context.Prepared]:
    admission = gate_admission(request) or await db_threads.for_request(request, admitted, request)
    parsed = await render_pool.run(admission.tenant.pk, parse, request, admission)
    prep = await db_threads.for_request(request, _finish, early, admission.tenant, parsed,
                                        wants_diagnostics(request, parsed.body))
    return admission, parsed, prep

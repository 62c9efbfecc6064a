"""A named cache's creation (``POST /v1/caches``) in the stages of a completion (``serving.context``),
each where its cost belongs:

1. admission, before the body is read (``serving.gate``; the view's own for a request that did not
   come through it): the key, the request counted against ``requests_per_minute``, the body's limit;
2. ``parse``, in the render pool (``serving.render_pool``: no database): the body within the
   admission's limit, its model among the granted ones, the bounds, the schema, the TTL, the prefix
   tokenized or its chat rendered (within the render budget);
3. ``prepare``, on a serving database thread: the quotas and the worker request of a one-token
   completion of the prefix;
4. ``run``, on the event loop: the worker's prewarm. A client that goes away meanwhile has it cancelled
   on its worker like a completion (``gateway.cancel_request``), and what it did by then (the
   worker's usage: the tokens it wrote to the cache) is booked in the ledger when the worker answers;
5. ``record``, on a serving database thread: the row and its pin as far as ``max_pinned_tokens``
   allows (one atomic step, ``services.cache_create``), the prewarm's usage booked (``accountant``).
   The pin goes to the replicas afterwards, off the database threads (``workers.pin_everywhere``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass

from django.http import HttpRequest

from controlplane.caches import services, workers
from controlplane.caches.models import NamedCache
from controlplane.caches.schemas import CacheCreate
from controlplane.common.actor import Actor
from controlplane.common.errors import TooLarge, WorkerError
from controlplane.registry.models import ModelDeployment
from controlplane.runtime import gateway
from controlplane.serving import accountant, bounds, context, intake
from controlplane.serving.admission import Admission
from controlplane.serving.model_facts import ModelFacts, model_facts
from controlplane.serving.schemas import CompletionRequest

logger = logging.getLogger("controlplane.caches")

PREWARM_TIMEOUT_S = 300.0
_abandoned: set[asyncio.Future] = set()  # prewarms whose client left, awaited until they are booked


@dataclass(frozen=True)
class Parsed:
    """A ``POST /v1/caches`` body, parsed, bounded, validated and tokenized: ``tokens`` is the prefix
    (a chat's ``messages`` rendered without a generation prompt)."""

    deployment: ModelDeployment
    facts: ModelFacts
    body: CacheCreate
    messages: list[dict] | None
    tokens: list[int]
    adapter: object = None  # adapters.selectors.AdapterRef: the LoRA adapter the body named


def parse(request: HttpRequest, admission: Admission) -> Parsed:
    """Stage 2 (render pool; no database): 413 over the admission's body limit or a render past its
    budget, 400 for bytes that are not a JSON object or a prompt the tokenizer refuses, 404 for a
    model not granted, 422 for a bad field or TTL."""
    tenant = admission.tenant
    data = intake.decode_body(request, admission.body_limit)
    deployment, _adapter = admission.resolve(intake.model_name(data))  # an adapter's cache lives in its scope
    facts = model_facts(deployment)
    prompt_bounds = bounds.prompt_bounds(facts, tenant.max_prompt_tokens)
    if "messages" in data:
        bounds.check_messages(data, prompt_bounds)
    else:
        bounds.check_prompt(data, prompt_bounds)
    body = intake.validate(data, CacheCreate)
    services.check_ttl(tenant, body.ttl_seconds)
    if body.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tokens = _render_prefix(facts, messages, intake.render_budget(prompt_bounds))
    else:
        messages = None
        tokens = facts.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    return Parsed(deployment=deployment, facts=facts, body=body, messages=messages, tokens=tokens,
                  adapter=admission.adapter(body.model))


def _render_prefix(facts: ModelFacts, messages: list[dict], budget) -> list[int]:
    """A chat prefix as the template renders it inside a longer chat: no generation prompt."""
    from cachecore.errors import CacheError
    from cachecore.model.template_guard import RenderLimitExceeded

    try:
        return facts.chat.render(messages, add_generation_prompt=False, budget=budget)
    except RenderLimitExceeded as exc:
        raise TooLarge(str(exc), code=exc.code) from None
    except CacheError as exc:
        raise intake.BadRequest(str(exc), code=exc.code) from None


def prepare(admission: Admission, parsed: Parsed) -> context.Prepared:
    """Stage 3 (database): the quotas, bounds and worker request of a one-token completion of the prefix."""
    as_completion = CompletionRequest(model=parsed.body.model, prompt=parsed.tokens, max_tokens=1, temperature=0.0,
                                      cache_salt=parsed.body.cache_salt)
    return context._finish(admission.tenant, parsed.deployment, parsed.facts, as_completion, parsed.tokens,
                           adapter=parsed.adapter)


async def run(prep: context.Prepared) -> dict:
    """Stage 4: the worker's prewarm of ``prep`` (its answer, ``workers.named_caches``). A worker error
    is raised as the API's error, once what the run did is booked. Cancelled (the client went away):
    the prewarm is cancelled on its worker, and its answer, when it comes, is booked."""
    call = asyncio.ensure_future(gateway.acall(prep.spec, "prewarm", prep.worker_req, None, timeout=PREWARM_TIMEOUT_S))
    try:
        res = await asyncio.shield(call)
    except asyncio.CancelledError:
        gateway.cancel_request(prep.spec, prep.worker_req["request_id"])
        _abandoned.add(call)
        call.add_done_callback(functools.partial(_book_abandoned, prep))
        raise
    if res.get("error"):
        if res.get("usage"):  # stopped by the platform: what it wrote is cached, and booked
            book(prep, res["usage"])
        raise WorkerError.from_event(res["error"])
    return res


def _book_abandoned(prep: context.Prepared, call: asyncio.Future) -> None:
    """The answer of a prewarm whose client went away: its usage (what it did before its cancel
    landed, or all of it when it finished first) into the ledger."""
    _abandoned.discard(call)
    if call.cancelled():
        return
    if call.exception() is not None:
        logger.warning("an abandoned prewarm of %s failed: %r", prep.model, call.exception())
        return
    usage = call.result().get("usage")
    if usage:
        book(prep, usage)
    else:
        logger.info("an abandoned prewarm of %s ended without usage: nothing to book", prep.model)


def book(prep: context.Prepared, usage: dict) -> None:
    """The prewarm's ``usage`` (the worker's) into the tenant's ledger and diagnostics history, off the
    response path (``serving.accountant``)."""
    accountant.submit(prep, {"type": "finished", "revision": prep.accounting.revision, "usage": usage})


def record(admission: Admission, actor: Actor, parsed: Parsed, prep: context.Prepared, res: dict
           ) -> tuple[NamedCache, workers.Target | None]:
    """Stage 5 (database): the row, pinned when the tenant's quota has room for the prefix's full blocks
    (the engine's blocks: the worker said how large), and the prewarm booked. Returns the row and,
    when it is pinned, the ``Target`` the caller pins on every replica."""
    usage = res.get("usage") or {}
    bs = int(usage.get("block_size") or prep.accounting.block_size)
    cache = services.cache_create(
        tenant=admission.tenant, deployment=parsed.deployment, revision=prep.spec.revision["label"],
        kind="messages" if parsed.messages is not None else "prompt", token_ids=prep.tokens,
        messages=parsed.messages, cache_salt=parsed.body.cache_salt, display_name=parsed.body.display_name,
        ttl_seconds=parsed.body.ttl_seconds, pin_tokens=len(prep.tokens) // bs * bs, tiers=res.get("tiers") or {},
        key_prefix=admission.key_prefix, actor=actor, block_size=bs,
        adapter_id=parsed.adapter.id if parsed.adapter is not None else None)
    if usage:
        book(prep, usage)
    return cache, workers.target(cache) if cache.pinned_tokens else None

"""Tenant endpoints for named caches (``/v1/caches``), OpenAI-style JSON with the serving API's errors.

- ``POST /v1/caches`` ``{"model", "prompt" | "messages", "ttl_seconds"?, "display_name"?, "cache_salt"?}``
  prefills the prefix once on a replica (a prewarm: the response comes after its KV is in L2 and, when
  the tenant persists, in L3), pins it as far as ``max_pinned_tokens`` allows, 201.
- ``GET /v1/caches``, ``GET /v1/caches/{id}``, ``PATCH /v1/caches/{id}`` ``{"ttl_seconds"}``,
  ``DELETE /v1/caches/{id}`` (the bytes leave every tier).

Another tenant's id is a 404 exactly like a missing one. Every call counts against the tenant's
requests per minute; a prewarm also against its tokens per minute, like a completion of its prefix.
"""

from __future__ import annotations

from typing import Annotated

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from controlplane.caches import selectors, services, workers
from controlplane.caches.models import NamedCache
from controlplane.common.actor import Actor
from controlplane.common.errors import NotFound, WorkerError
from controlplane.common.sources import request_source
from controlplane.runtime import gateway
from controlplane.serving import accounting, bounds, context, intake, ratelimit
from controlplane.serving.admission import authenticate_key, body_limit_for
from controlplane.serving.model_facts import model_facts
from controlplane.serving.schemas import CompletionRequest, Message, TokenId
from controlplane.serving.views import _api_view
from controlplane.tenants.models import Tenant

PREWARM_TIMEOUT_S = 300.0


class CacheCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    ttl_seconds: StrictInt = services.TTL_DEFAULT
    display_name: Annotated[str, Field(max_length=200)] = ""
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_source(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if isinstance(self.prompt, str) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self


class CachePatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttl_seconds: StrictInt


def present(cache: NamedCache) -> dict:
    return {"id": cache.public_id, "object": "cache", "model": cache.deployment.name,
            "display_name": cache.display_name, "kind": cache.kind, "tokens": cache.tokens,
            "pinned_tokens": cache.pinned_tokens, "tiers": cache.tiers,
            "created_at": int(cache.created.timestamp()), "expires_at": int(cache.expires_at.timestamp())}


def _tenant(request: HttpRequest) -> tuple[Tenant, Actor, str]:
    """The calling tenant (counted against its requests per minute), its actor for the audit log and
    its key's prefix."""
    where = request_source(request)
    result = authenticate_key(request.headers.get("Authorization", ""), where=where,
                              target=f"{request.method} {request.path}")
    tenant = result.tenant
    ratelimit.count_request(tenant_id=tenant.pk, requests_per_minute=tenant.requests_per_minute)
    prefix = result.api_key.prefix
    return tenant, Actor.at(f"tenant:{tenant.slug}:{prefix}", "api_key", where), prefix


def _prepare_create(request: HttpRequest):
    tenant, actor, prefix = _tenant(request)
    data = intake.decode_body(request, body_limit_for("/v1/completions", tenant))
    deployment = context.resolve_model(tenant, intake.model_name(data))
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
    # The quotas, bounds and worker request of a one-token completion of the prefix.
    as_completion = CompletionRequest(model=body.model, prompt=tokens, max_tokens=1, temperature=0.0,
                                      cache_salt=body.cache_salt)
    prep = context._finish(tenant, deployment, facts, as_completion, tokens)
    return tenant, actor, prefix, deployment, body, messages, prep


def _render_prefix(facts, messages: list[dict], budget) -> list[int]:
    """A chat prefix as the template renders it inside a longer chat: no generation prompt."""
    from cachecore.errors import CacheError
    from cachecore.model.template_guard import RenderLimitExceeded
    from controlplane.common.errors import TooLarge

    try:
        return facts.chat.render(messages, add_generation_prompt=False, budget=budget)
    except RenderLimitExceeded as exc:
        raise TooLarge(str(exc), code=exc.code) from None
    except CacheError as exc:
        raise intake.BadRequest(str(exc), code=exc.code) from None


def _finish_create(tenant, actor, prefix, deployment, body, messages, prep, res) -> NamedCache:
    """The row, then the pin on every replica when the tenant's quota has room for the prefix's full
    blocks (the engine's blocks: the worker said how large)."""
    usage = res.get("usage") or {}
    bs = int(usage.get("block_size") or prep.accounting.block_size)
    cache = services.cache_create(
        tenant=tenant, deployment=deployment, revision=prep.spec.revision["label"],
        kind="messages" if messages is not None else "prompt", token_ids=prep.tokens, messages=messages,
        cache_salt=body.cache_salt, display_name=body.display_name, ttl_seconds=body.ttl_seconds,
        pin_tokens=len(prep.tokens) // bs * bs, tiers=res.get("tiers") or {}, key_prefix=prefix, actor=actor,
        block_size=bs)
    if cache.pinned_tokens:  # every replica protects it in its L2, and in its view of L3
        workers.pin_everywhere(cache, cache.expires_at.timestamp())
    if usage:
        accounting.account(prep, {"type": "finished", "revision": cache.revision, "usage": usage})
    return cache


@_api_view(("GET", "POST"))
async def caches(request: HttpRequest):
    if request.method == "GET":
        return JsonResponse(await sync_to_async(_list, thread_sensitive=True)(request))
    tenant, actor, prefix, deployment, body, messages, prep = await sync_to_async(
        _prepare_create, thread_sensitive=True)(request)
    res = await gateway.acall(prep.spec, "prewarm", prep.worker_req, None, timeout=PREWARM_TIMEOUT_S)
    if res.get("error"):
        raise WorkerError.from_event(res["error"])
    cache = await sync_to_async(_finish_create, thread_sensitive=True)(
        tenant, actor, prefix, deployment, body, messages, prep, res)
    return JsonResponse(present(cache), status=201)


def _list(request: HttpRequest) -> dict:
    tenant, _, _ = _tenant(request)
    return {"object": "list", "data": [present(c) for c in selectors.caches_live(tenant)]}


def _one(request: HttpRequest, cache_id: str) -> dict | None:
    tenant, actor, prefix = _tenant(request)
    cache = selectors.cache_get(tenant, cache_id)
    if cache is None:
        raise NotFound(f"cache '{cache_id}' does not exist", code="cache_not_found")
    if request.method == "GET":
        return present(cache)
    if request.method == "PATCH":
        patch = intake.validate(intake.decode_body(request, 4096), CachePatch)
        services.cache_set_ttl(cache, ttl_seconds=patch.ttl_seconds, actor=actor, key_prefix=prefix,
                               repin=lambda c, until: workers.pin_everywhere(c, until))
        return present(cache)
    services.cache_delete(cache, actor=actor, key_prefix=prefix, reason="deleted by the tenant")
    return None


@_api_view(("GET", "PATCH", "DELETE"))
async def cache_detail(request: HttpRequest, cache_id: str):
    out = await sync_to_async(_one, thread_sensitive=True)(request, cache_id)
    if out is None:
        return JsonResponse({"id": cache_id, "object": "cache.deleted", "deleted": True})
    return JsonResponse(out)

"""Tenant endpoints for named caches (``/v1/caches``), OpenAI-style JSON with the serving API's errors.

- ``POST /v1/caches`` ``{"model", "prompt" | "messages", "ttl_seconds"?, "display_name"?, "cache_salt"?}``
  prefills the prefix once on a replica (a prewarm: the response comes after its KV is in L2 and, when
  the tenant persists, in L3), pins it as far as ``max_pinned_tokens`` allows, 201 (``prewarm``).
- ``GET /v1/caches``, ``GET /v1/caches/{id}``, ``PATCH /v1/caches/{id}`` ``{"ttl_seconds"}``,
  ``DELETE /v1/caches/{id}`` (the bytes leave every tier).

Every call is a serving call like a completion: admitted by ``serving.gate`` before its body is read
(401/403/429 and a body announced over its limit, 413, answered unread), counted once against the
tenant's requests per minute (a prewarm also against its tokens per minute, like a completion of its
prefix); its database work runs on the serving database threads, a prewarm's parsing and rendering in
the render pool, and the replicas' pin and delete calls on threads of their own (``workers.Target``).
A PATCH body is at most ``admission.SMALL_JSON_BODY`` bytes: parsed in its database job, as a small
completion is (``context.INLINE_BODY``).

Another tenant's id is a 404 exactly like a missing one.
"""

from __future__ import annotations

import asyncio

from django.http import HttpRequest, JsonResponse

from controlplane.caches import prewarm, residency, selectors, services, workers
from controlplane.caches.models import NamedCache
from controlplane.caches.schemas import CachePatch
from controlplane.common.actor import Actor
from controlplane.common.errors import NotFound
from controlplane.common.sources import request_source
from controlplane.serving import db_threads, intake, render_pool
from controlplane.serving.admission import Admission, admitted, gate_admission
from controlplane.serving.views import _api_view


def present(cache: NamedCache, where: residency.Residency | None = None) -> dict:
    """The cache as the API shows it: ``tiers`` where its tokens are (``where``: asked from the replicas,
    or the last known figures, ``tiers_stale`` and ``tiers_as_of``); without ``where``, as recorded."""
    where = where or residency.recorded(cache)
    return {"id": cache.public_id, "object": "cache", "model": cache.adapter.name if cache.adapter_id
            else cache.deployment.name,
            "display_name": cache.display_name, "kind": cache.kind, "tokens": cache.tokens,
            "pinned_tokens": cache.pinned_tokens, **where.as_json(),
            "created_at": int(cache.created.timestamp()), "expires_at": int(cache.expires_at.timestamp())}


async def _present_now(request: HttpRequest, caches: list[NamedCache], found: dict) -> list[dict]:
    """``caches`` presented with where their tokens are now: the replicas asked off the database threads
    (``residency.ask``, bounded), the answer remembered and presented on one."""
    answered = await asyncio.to_thread(residency.ask, found)
    return await db_threads.for_request(request, _remembered, caches, answered)


def _remembered(caches: list[NamedCache], answered: dict) -> list[dict]:
    residency.remember(caches, answered)
    return [present(c, residency.residency(c, answered)) for c in caches]


def _actor(request: HttpRequest, admission: Admission) -> Actor:
    """The calling tenant's key, as the audit log names it."""
    return Actor.at(f"tenant:{admission.tenant.slug}:{admission.key_prefix}", "api_key", request_source(request))


@_api_view(("GET", "POST"))
async def caches(request: HttpRequest):
    if request.method == "GET":
        caches, found = await db_threads.for_request(request, _list, request)
        return JsonResponse({"object": "list", "data": await _present_now(request, caches, found)})
    admission = gate_admission(request) or await db_threads.for_request(request, admitted, request)
    parsed = await render_pool.run(admission.tenant.pk, prewarm.parse, request, admission)
    prep = await db_threads.for_request(request, prewarm.prepare, admission, parsed)
    res = await prewarm.run(prep)
    cache, target = await db_threads.for_request(request, prewarm.record, admission, _actor(request, admission),
                                                 parsed, prep, res)
    if target is not None:  # every replica protects it in its L2, and in its view of L3
        await asyncio.to_thread(workers.pin_everywhere, target, cache.expires_at.timestamp())
    return JsonResponse(present(cache), status=201)


def _list(request: HttpRequest) -> tuple[list[NamedCache], dict]:
    caches = list(selectors.caches_live(admitted(request).tenant))
    return caches, residency.targets(caches)


def _find(request: HttpRequest, cache_id: str) -> tuple[Admission, NamedCache]:
    """The request's admission and the tenant's live cache ``cache_id`` (404 for another's)."""
    admission = admitted(request)
    cache = selectors.cache_get(admission.tenant, cache_id)
    if cache is None:
        raise NotFound(f"cache '{cache_id}' does not exist", code="cache_not_found")
    return admission, cache


def _get(request: HttpRequest, cache_id: str) -> tuple[list[NamedCache], dict]:
    caches = [_find(request, cache_id)[1]]
    return caches, residency.targets(caches)


def _patch(request: HttpRequest, cache_id: str) -> tuple[dict, workers.Target | None, NamedCache]:
    """The new TTL recorded; the ``Target`` to pin again when the cache is pinned."""
    admission, cache = _find(request, cache_id)
    patch = intake.validate(intake.decode_body(request, admission.body_limit), CachePatch)
    services.cache_set_ttl(cache, ttl_seconds=patch.ttl_seconds, actor=_actor(request, admission),
                           key_prefix=admission.key_prefix)
    return present(cache), workers.target(cache) if cache.pinned_tokens else None, cache


def _to_delete(request: HttpRequest, cache_id: str) -> tuple[Admission, NamedCache, workers.Target]:
    admission, cache = _find(request, cache_id)
    return admission, cache, workers.target(cache)


def _deleted(request: HttpRequest, admission: Admission, cache: NamedCache, results: dict) -> None:
    services.cache_deleted(cache, results=results, actor=_actor(request, admission), key_prefix=admission.key_prefix,
                           reason="deleted by the tenant")


@_api_view(("GET", "PATCH", "DELETE"))
async def cache_detail(request: HttpRequest, cache_id: str):
    if request.method == "GET":
        caches, found = await db_threads.for_request(request, _get, request, cache_id)
        return JsonResponse((await _present_now(request, caches, found))[0])
    if request.method == "PATCH":
        out, target, cache = await db_threads.for_request(request, _patch, request, cache_id)
        if target is not None:
            await asyncio.to_thread(workers.pin_everywhere, target, cache.expires_at.timestamp())
        return JsonResponse(out)
    admission, cache, target = await db_threads.for_request(request, _to_delete, request, cache_id)
    results = await asyncio.to_thread(workers.drop_everywhere, target)
    await db_threads.for_request(request, _deleted, request, admission, cache, results)
    return JsonResponse({"id": cache_id, "object": "cache.deleted", "deleted": True})

"""Turn an HTTP request into a worker request: authenticate, validate, resolve scope, apply quotas.

Everything that decides *whose* cache a request may touch happens here, on the server: the scope
salt comes from the authenticated tenant (or the share group it was put in), the namespace's model
revision from the registry. A client's ``cache_salt`` is passed on only as a narrowing salt.

L3 fields of every worker request (completions and KV API): ``persist`` (bool: may this request's KV
be written to L3, and may it be read from there), ``retention_seconds`` (int: how long it may be
served from there, and the expiry of the L3 objects it writes), ``tenant_retention_seconds`` (the
tenant's own retention, which the worker's sweep applies) and
``data_key`` (``tenants.datakeys.data_key_for_worker``: the tenant's active data-key version and
wrapped key, every readable version's wrapped key, and the shredded versions; the worker unwraps them
with the master key, bound to ``req["tenant"]``).

Tokenizer, chat template and limits come from ``model_facts.model_facts(deployment)`` (the preset's or
the checkpoint's own, loaded as the worker loads them).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.http import HttpRequest
from pydantic import BaseModel

from controlplane.common.asgi_limits import KV_STORE_PATH, body_limit
from controlplane.common.errors import (
    Forbidden,
    InvalidInput,
    NotFound,
    TooLarge,
    Unauthenticated,
)
from controlplane.common.sources import request_source
from controlplane.registry.models import ModelDeployment
from controlplane.runtime import gateway
from controlplane.runtime.gateway import WorkerSpec
from controlplane.serving import bounds, intake, keyguard, ratelimit, render_pool
from controlplane.serving.intake import BadRequest
from controlplane.serving.model_facts import ModelFacts, model_facts
from controlplane.tenants import selectors as tenant_selectors
from controlplane.tenants import services as tenant_services


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for its worker."""

    spec: WorkerSpec
    body: BaseModel
    model: str
    tokens: list[int]
    worker_req: dict


def authenticate(request: HttpRequest):
    """The tenant behind the bearer key. 401 for a missing/unknown/revoked key, 403 if not active, 429
    for a bad key from a source that sent too many (``keyguard``; a valid key is never refused)."""
    header = request.headers.get("Authorization", "")
    scheme, _, raw = header.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    key, where = raw.strip(), request_source(request)
    retry_after = keyguard.api_key_retry_after(where=where)  # failures throttled, valid keys never
    result = (tenant_selectors.tenant_authenticate(key)
              if keyguard.api_key_worth_checking(key, retry_after=retry_after) else None)
    if result is None or result.status == "revoked":
        keyguard.api_key_rejected(where=where, key=key, target=f"{request.method} {request.path}",
                                  retry_after=retry_after)
        raise Unauthenticated("invalid API key", code="invalid_api_key")
    if not result.ok:
        raise Forbidden("this tenant is suspended", code="tenant_suspended")
    tenant_services.api_key_mark_used(api_key=result.api_key)
    return result.tenant


def admit_request(request: HttpRequest):
    """The authenticated tenant, its request already counted against ``requests_per_minute`` (429 past
    it): before the body is read or parsed, so requests refused later count too."""
    tenant = authenticate(request)
    ratelimit.count_request(tenant_id=tenant.pk, requests_per_minute=tenant.requests_per_minute)
    return tenant


def body_limit_for(path: str, tenant) -> int:
    """The most body a request to ``path`` may have for ``tenant``: what the largest prompt, token list
    or KV upload the tenant's granted models allow can need (``bounds``), at most the path's limit.
    Checked before the body is read (``gate``, from Content-Length) or parsed."""
    route = path.rstrip("/")
    limit = bounds.kv_store_body_limit if route == KV_STORE_PATH else (
        bounds.token_list_body_limit if route.startswith("/v1/kv/")
        else lambda facts: bounds.prompt_body_limit(facts, tenant.max_prompt_tokens))
    grants = tenant_selectors.grant_list(tenant=tenant).select_related("deployment__active_revision")
    needed = [limit(model_facts(g.deployment)) for g in grants if g.deployment.active_revision_id is not None]
    return min(max(needed, default=bounds.BODY_SLACK), body_limit(path))


def admit_with_limit(request: HttpRequest):
    """``admit_request`` and ``body_limit_for``: (tenant, body limit), both before the body is parsed."""
    tenant = admit_request(request)
    return tenant, body_limit_for(request.path, tenant)


def resolve_model(tenant, name: str) -> ModelDeployment:
    """The granted deployment; 404 alike for unknown and not granted (no enumeration)."""
    deployment = tenant_selectors.grant_get_deployment(tenant, name)
    if deployment is None or deployment.active_revision is None:
        raise NotFound(f"model '{name}' does not exist or you do not have access to it", code="model_not_found")
    return deployment


def resolve(tenant, data: dict) -> tuple[ModelDeployment, ModelFacts]:
    """The deployment ``data`` names (granted to ``tenant``) and its facts, before the rest is validated."""
    deployment = resolve_model(tenant, intake.model_name(data))
    return deployment, model_facts(deployment)


RETENTION_24H = 86_400


def retention_for(tenant, prompt_cache_retention: str | None) -> int:
    """Seconds this request's persisted KV may be served: the tenant's retention, at most 24 h when
    the request says ``"24h"``."""
    if prompt_cache_retention == "24h":
        return min(tenant.retention_seconds, RETENTION_24H)
    return tenant.retention_seconds


def persist_allowed(tenant, prompt_cache_retention: str | None) -> bool:
    """May this request's KV go beyond host memory (L3)? Only if the tenant allows persistence with a
    retention above 0 and the request did not ask for ``"in_memory"``."""
    return bool(tenant.persist_kv and tenant.retention_seconds > 0 and prompt_cache_retention != "in_memory")


async def prepare(request: HttpRequest, schema: type[BaseModel]) -> Prepared:
    """A completion or chat request, admitted in the order that bounds what each step may cost: the
    tenant authenticated and its request counted; the body (bounded by ``body_limit_for``) parsed, then
    checked against the model's and tenant's bounds, validated and tokenized in the render pool (off
    the event loop, at most ``STRATA_RENDER_THREADS`` renders at once and the tenant's share of them);
    the token quotas last. Database steps run in Django's sync thread of the request."""
    tenant, limit = await sync_to_async(admit_with_limit, thread_sensitive=True)(request)
    data = await render_pool.run(tenant.pk, intake.decode_body, request, limit)
    deployment, config = await sync_to_async(resolve, thread_sensitive=True)(tenant, data)
    body, tokens = await render_pool.run(tenant.pk, intake.render, data, schema, config, tenant.max_prompt_tokens)
    return await sync_to_async(_finish, thread_sensitive=True)(tenant, deployment, config, body, tokens)


def _prepare(request: HttpRequest, schema: type[BaseModel]) -> Prepared:
    """``prepare`` in the calling thread (benchmarks and tests that build a worker request directly)."""
    tenant, limit = admit_with_limit(request)
    data = intake.decode_body(request, limit)
    deployment, config = resolve(tenant, data)
    body, tokens = intake.render(data, schema, config, tenant.max_prompt_tokens)
    return _finish(tenant, deployment, config, body, tokens)


def _finish(tenant, deployment: ModelDeployment, config: ModelFacts, body: BaseModel, tokens: list[int]) -> Prepared:
    """The exact checks once the prompt is tokenized (vocabulary, tenant limit, context, tokens per
    minute) and the worker request."""
    bad = next((t for t in tokens if t >= config.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary [0, {config.vocab_size})", code="invalid_prompt")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if tenant.max_prompt_tokens is not None and len(tokens) > tenant.max_prompt_tokens:
        raise TooLarge(f"prompt has {len(tokens)} tokens; this tenant's limit is {tenant.max_prompt_tokens}",
                       code="prompt_too_long")
    if len(tokens) + max_tokens > config.max_seq_len:
        raise BadRequest(f"prompt of {len(tokens)} tokens plus max_tokens={max_tokens} exceeds the model's "
                         f"context length of {config.max_seq_len}", code="context_length_exceeded")
    ratelimit.admit(tenant_id=tenant.pk, requests_per_minute=None,  # counted by admit_request
                    tokens_per_minute=tenant.tokens_per_minute, tokens=len(tokens) + max_tokens)
    logprobs = body.logprobs
    if hasattr(body, "messages"):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    spec = gateway.spec_for(deployment)
    worker_req = {
        "tenant": str(tenant.pk),
        "scope_salt": tenant_selectors.tenant_scope_salt(tenant),
        "cache_salt": body.cache_salt,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "seed": body.seed,
        "logprobs": logprobs,
        "stop": body.stop,
        "user": body.user,  # the router's stickiness key (scoped to the tenant there); never hashed into KV
        "max_cached_tokens": tenant.max_cached_tokens,
        "max_l3_bytes": tenant.max_l3_bytes,
        # L3 policy: the tenant's (may it persist at all, for how long), narrowed by the request's
        # prompt_cache_retention ("in_memory": never beyond host memory; "24h": at most a day).
        "persist": persist_allowed(tenant, body.prompt_cache_retention),
        "retention_seconds": retention_for(tenant, body.prompt_cache_retention),
        "tenant_retention_seconds": tenant.retention_seconds,  # the worker's sweep applies the tenant's own
        "data_key": tenant_selectors.data_key_for_worker(tenant),
        "max_inflight_tokens": tenant.max_inflight_tokens,
        "max_concurrent_requests": tenant.max_concurrent_requests,
        "share_weight": tenant.share_weight,
        "expected_revision": spec.revision["label"],
        "request_id": uuid.uuid4().hex,  # the gateway cancels it on the worker if the client goes away
    }
    return Prepared(spec=spec, body=body, model=deployment.name, tokens=tokens, worker_req=worker_req)


def _check_kv_tokens(tokens: list[int], deployment: ModelDeployment, tenant=None) -> None:
    """KV API token lists: bounded by the model's context length and the tenant's ``max_prompt_tokens``
    (413) and inside its vocabulary (422), checked before any worker is involved."""
    config = model_facts(deployment)
    limit = getattr(tenant, "max_prompt_tokens", None)
    if limit is not None and len(tokens) > limit:
        raise TooLarge(f"{len(tokens)} tokens; this tenant's limit is {limit}", code="prompt_too_long")
    if len(tokens) > config.max_seq_len:
        raise TooLarge(f"{len(tokens)} tokens exceed the model's context length of {config.max_seq_len}",
                       code="context_length_exceeded")
    bad = next((t for t in tokens if not 0 <= t < config.vocab_size), None)
    if bad is not None:
        raise InvalidInput(f"token id {bad} is outside the vocabulary [0, {config.vocab_size})", code="invalid_prompt")


def _prepare_kv(request: HttpRequest, schema: type[BaseModel]) -> tuple[WorkerSpec, BaseModel, dict]:
    """A KV API request, under the same quotas as a completion: its token list counts as a prompt
    (``max_prompt_tokens``: 413) and against tokens-per-minute, every call against requests-per-minute,
    and the worker counts it against ``max_concurrent_requests`` while it runs (lookups and retrieves
    count their tokens too: each hashes them, and a retrieve copies KV out). ``tenant_salt`` is the
    tenant's own salt: uploads are keyed under it alone (never the share group's)."""
    tenant, limit = admit_with_limit(request)  # counted, and the body bounded, before it is parsed
    data = intake.decode_body(request, limit)
    deployment, facts = resolve(tenant, data)
    bounds.check_token_list(data.get("tokens"), facts)  # before pydantic looks at every id
    body = intake.validate(data, schema)
    tokens = list(body.tokens)
    _check_kv_tokens(tokens, deployment, tenant)
    ratelimit.admit(tenant_id=tenant.pk, requests_per_minute=None,  # counted by admit_request
                    tokens_per_minute=tenant.tokens_per_minute, tokens=len(tokens))
    return gateway.spec_for(deployment), body, {
        "tenant": str(tenant.pk),
        "scope_salt": tenant_selectors.tenant_scope_salt(tenant),
        "tenant_salt": bytes(tenant.scope_salt),
        "cache_salt": body.cache_salt,
        "tokens": tokens,
        "max_cached_tokens": tenant.max_cached_tokens,
        "max_l3_bytes": tenant.max_l3_bytes,
        "max_concurrent_requests": tenant.max_concurrent_requests,
        "share_weight": tenant.share_weight,
        "persist": persist_allowed(tenant, None),
        "retention_seconds": retention_for(tenant, None),
        "tenant_retention_seconds": tenant.retention_seconds,
        "data_key": tenant_selectors.data_key_for_worker(tenant),
    }


prepare_kv = sync_to_async(_prepare_kv, thread_sensitive=True)


def _layout_spec(request: HttpRequest, model: str) -> WorkerSpec:
    tenant = authenticate(request)
    if not model:
        raise BadRequest("query parameter 'model' is required", code="missing_model")
    return gateway.spec_for(resolve_model(tenant, model))


layout_spec = sync_to_async(_layout_spec, thread_sensitive=True)


def _models_for(request: HttpRequest) -> list[ModelDeployment]:
    tenant = authenticate(request)
    grants = tenant_selectors.grant_list(tenant=tenant).select_related("deployment")
    return [g.deployment for g in grants if g.deployment.active_revision_id is not None]


models_for = sync_to_async(_models_for, thread_sensitive=True)

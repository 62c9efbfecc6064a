"""Turn an HTTP request into a worker request: authenticate, validate, resolve scope, apply quotas.

Everything that decides *whose* cache a request may touch happens here, on the server: the scope
salt comes from the authenticated tenant (or the share group it was put in), the namespace's model
revision from the registry. A client's ``cache_salt`` is passed on only as a narrowing salt.

L3 fields of every worker request (completions and KV API): ``persist`` (bool: may this request's KV
be written to L3), ``retention_seconds`` (int: how long it may be served from there) and
``data_key`` (``tenants.datakeys.data_key_for_worker``: the tenant's active data-key version and
wrapped key, every readable version's wrapped key, and the shredded versions; the worker unwraps them
with the master key, bound to ``req["tenant"]``).

Tokenizer, chat template and limits come from ``model_facts.model_facts(deployment)`` (the preset's or
the checkpoint's own, loaded as the worker loads them).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest
from pydantic import BaseModel, ValidationError

from cachecore.errors import CacheError
from controlplane.common.errors import (
    ApplicationError,
    Forbidden,
    InvalidInput,
    NotFound,
    TooLarge,
    Unauthenticated,
)
from controlplane.registry.models import ModelDeployment
from controlplane.runtime import gateway
from controlplane.runtime.gateway import WorkerSpec
from controlplane.serving import ratelimit
from controlplane.serving.model_facts import BYTE_CHAT, BYTE_TOKENIZER, ModelFacts, model_facts
from controlplane.tenants import selectors as tenant_selectors
from controlplane.tenants import services as tenant_services


class BadRequest(ApplicationError):
    status = 400
    code = "invalid_request"


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for its worker."""

    spec: WorkerSpec
    body: BaseModel
    model: str
    tokens: list[int]
    worker_req: dict


def parse_body(request: HttpRequest, schema: type[BaseModel]) -> BaseModel:
    """JSON body -> schema instance. 400 for bytes that are not UTF-8 JSON objects, 422 for fields,
    413 for a body over the limit (also when it came chunked, without a Content-Length to refuse early)."""
    limit = settings.STRATA_MAX_BODY_BYTES
    try:
        body = request.body
    except RequestDataTooBig:
        body = None
    if body is None or len(body) > limit:
        raise TooLarge(f"request body too large (limit {limit} bytes)")
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
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidInput(f"{where}: {first.get('msg', 'invalid value')}", code="invalid_value") from None


def authenticate(request: HttpRequest):
    """The tenant behind the bearer key. 401 for a missing/unknown/revoked key, 403 if not active."""
    header = request.headers.get("Authorization", "")
    scheme, _, raw = header.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    result = tenant_selectors.tenant_authenticate(raw.strip())
    if result is None or result.status == "revoked":
        raise Unauthenticated("invalid API key", code="invalid_api_key")
    if not result.ok:
        raise Forbidden("this tenant is suspended", code="tenant_suspended")
    tenant_services.api_key_mark_used(api_key=result.api_key)
    return result.tenant


def resolve_model(tenant, name: str) -> ModelDeployment:
    """The granted deployment; 404 alike for unknown and not granted (no enumeration)."""
    deployment = tenant_selectors.grant_get_deployment(tenant, name)
    if deployment is None or deployment.active_revision is None:
        raise NotFound(f"model '{name}' does not exist or you do not have access to it", code="model_not_found")
    return deployment


def tokenize(body: BaseModel, facts: ModelFacts | None = None) -> list[int]:
    tokenizer, chat = (facts.tokenizer, facts.chat) if facts is not None else (BYTE_TOKENIZER, BYTE_CHAT)
    try:
        if hasattr(body, "messages"):
            return chat.render([m.model_dump() for m in body.messages])
        if isinstance(body.prompt, str):
            return tokenizer.encode(body.prompt)
        return list(body.prompt)
    except CacheError as exc:
        raise BadRequest(str(exc), code=exc.code) from None


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


def _prepare(request: HttpRequest, schema: type[BaseModel]) -> Prepared:
    tenant = authenticate(request)
    body = parse_body(request, schema)
    deployment = resolve_model(tenant, body.model)
    config = model_facts(deployment)
    tokens = tokenize(body, config)
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
    ratelimit.admit(tenant_id=tenant.pk, requests_per_minute=tenant.requests_per_minute,
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
        "data_key": tenant_selectors.data_key_for_worker(tenant),
        "max_inflight_tokens": tenant.max_inflight_tokens,
        "max_concurrent_requests": tenant.max_concurrent_requests,
        "share_weight": tenant.share_weight,
        "expected_revision": spec.revision["label"],
        "request_id": uuid.uuid4().hex,  # the gateway cancels it on the worker if the client goes away
    }
    return Prepared(spec=spec, body=body, model=deployment.name, tokens=tokens, worker_req=worker_req)


prepare = sync_to_async(_prepare, thread_sensitive=True)


def _check_kv_tokens(tokens: list[int], deployment: ModelDeployment) -> None:
    """KV API token lists: bounded by the model's context length (413) and inside its vocabulary (422),
    checked before any worker is involved."""
    config = model_facts(deployment)
    if len(tokens) > config.max_seq_len:
        raise TooLarge(f"{len(tokens)} tokens exceed the model's context length of {config.max_seq_len}",
                       code="context_length_exceeded")
    bad = next((t for t in tokens if not 0 <= t < config.vocab_size), None)
    if bad is not None:
        raise InvalidInput(f"token id {bad} is outside the vocabulary [0, {config.vocab_size})", code="invalid_prompt")


def _prepare_kv(request: HttpRequest, schema: type[BaseModel], *, store: bool = False
                ) -> tuple[WorkerSpec, BaseModel, dict]:
    """A KV API request. Uploads (``store``) count their tokens against tokens-per-minute; every KV
    call counts against requests-per-minute. ``tenant_salt`` is the tenant's own salt: uploads are
    keyed under it alone (never the share group's)."""
    tenant = authenticate(request)
    body = parse_body(request, schema)
    deployment = resolve_model(tenant, body.model)
    tokens = list(body.tokens)
    _check_kv_tokens(tokens, deployment)
    ratelimit.admit(tenant_id=tenant.pk, requests_per_minute=tenant.requests_per_minute,
                    tokens_per_minute=tenant.tokens_per_minute if store else None,
                    tokens=len(tokens) if store else 0)
    return gateway.spec_for(deployment), body, {
        "tenant": str(tenant.pk),
        "scope_salt": tenant_selectors.tenant_scope_salt(tenant),
        "tenant_salt": bytes(tenant.scope_salt),
        "cache_salt": body.cache_salt,
        "tokens": tokens,
        "max_cached_tokens": tenant.max_cached_tokens,
        "max_l3_bytes": tenant.max_l3_bytes,
        "share_weight": tenant.share_weight,
        "persist": persist_allowed(tenant, None),
        "retention_seconds": retention_for(tenant, None),
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

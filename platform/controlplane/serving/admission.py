"""Who a serving request is and how much it may send, decided before its body is read.

``admit`` authenticates the bearer key (``keyguard`` throttling bad keys per source, valid keys never;
the key marked used), counts the request against the tenant's ``requests_per_minute`` (so a request
refused later still counts) and reads the tenant's granted deployments, which give its body limit
(``body_limit_for``) and, later, the request's model. The result, an ``Admission``, is made once per
request: by ``serving.gate`` before Django reads the body (handed to the view in the ASGI scope), by
the view's preparation job when the gate read a small body first and left a ``Deferred`` instead (one
hop to the database threads for both), or by the view itself (``admitted``) for a request that did
not come through the gate.

What a valid key resolves to (tenant, key, granted deployments) is kept in this process
(``access_cache``) while the access generation (``access_generation``, moved by database triggers on
every change to keys, tenants, grants and deployments) stands still: a warm key costs one indexed read
instead of the key lookup and the grant query, and a revoked key, a suspended tenant, a withdrawn
grant or a changed quota still acts on the very next request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.http import HttpRequest

from controlplane.common.asgi_limits import KV_STORE_PATH, body_limit
from controlplane.common.errors import ApplicationError, Forbidden, NotFound, Unauthenticated, Unavailable
from controlplane.common.sources import RequestSource, request_source
from controlplane.registry.models import ModelDeployment
from controlplane.serving import access_cache, access_generation, bounds, keyguard, ratelimit
from controlplane.serving.model_facts import model_facts
from controlplane.tenants import selectors as tenant_selectors
from controlplane.tenants import services as tenant_services
from controlplane.tenants.models import Tenant


@dataclass(frozen=True)
class Admission:
    """A request let in before its body is read: ``tenant`` authenticated (its key marked used) and this
    request counted against its ``requests_per_minute``; ``deployments``: the models granted to it with
    an active revision, by name; ``body_limit``: the most body this request may have (``body_limit_for``);
    ``key_prefix``: the visible prefix of the key it came with (what the audit log names)."""

    tenant: Tenant
    deployments: dict[str, ModelDeployment]
    body_limit: int
    key_prefix: str = ""
    adapters: dict[str, Any] = field(default_factory=dict)  # name -> adapters.selectors.AdapterRef it may use

    def deployment(self, name: str) -> ModelDeployment:
        """The granted deployment ``name``; 404 alike for unknown and not granted (no enumeration). An
        adapter's name is a 404 here: only the paths that serve adapters resolve them (``resolve``)."""
        deployment = self.deployments.get(name)
        if deployment is None:
            raise NotFound(f"model '{name}' does not exist or you do not have access to it", code="model_not_found")
        return deployment

    def resolve(self, name: str) -> tuple[ModelDeployment, Any]:
        """``(deployment, adapter)``: the granted deployment ``name`` (adapter None), or the adapter
        ``name`` this tenant may use (an ``adapters.selectors.AdapterRef``) with its base deployment;
        404 alike for unknown, not granted and another tenant's adapter (no enumeration: the same
        dictionary lookups and the same error, whatever the name is)."""
        deployment, adapter = self.deployments.get(name), None
        if deployment is None:
            adapter = self.adapters.get(name)
            deployment = self.deployments.get(adapter.deployment) if adapter is not None else None
        if deployment is None:
            raise NotFound(f"model '{name}' does not exist or you do not have access to it", code="model_not_found")
        return deployment, adapter

    def adapter(self, name: str):
        """The ``AdapterRef`` when ``name`` is an adapter this tenant may use (None: a model's name)."""
        return None if name in self.deployments else self.adapters.get(name)


@dataclass
class Deferred:
    """Left by ``serving.gate`` instead of an ``Admission`` when it read a small body before admitting
    the request: the view's preparation job admits it (``admitted``), in the same hop to the database
    threads. ``note``: the request's serving-metrics note (``health.Note``: its tenant is set here);
    ``on_refused``: the gate's memory, told of a ``rate_limit_requests`` refusal at once (before the
    answer leaves, so the client's next request finds it); ``admission``: the admission made (made
    once, however often it is asked for)."""

    note: Any = None
    admission: Admission | None = None
    on_refused: Callable[[ApplicationError], None] | None = None


API_KEY_PATHS = frozenset({"/v1/messages"})  # Anthropic's clients send the tenant key as ``x-api-key``
CACHES_PATH = "/v1/caches"  # named caches: POST (a prewarm: a prompt) and GET; ``/{id}``: GET, PATCH, DELETE
BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE"})
SMALL_JSON_BODY = bounds.BODY_SLACK  # a call without a prompt: ``{"ttl_seconds"}`` at most


# Where ``serving.gate`` leaves its ``Admission`` (or ``Deferred``) in the request's ASGI scope. Only the
# server writes a scope: nothing a client sends can put an object there.
ADMISSION_STATE = "strata.admission"
log = logging.getLogger(__name__)


def authenticate_key(header: str, *, where: RequestSource, target: str):
    """The ``AuthResult`` of an ``Authorization`` header value. 401 for a missing/unknown/revoked key, 403
    if its tenant is not active, 429 for a bad key from a source that sent too many (``keyguard``; a
    valid key is never refused). The key is marked used."""
    return _resolve(header, where=where, target=target)[0]


def _resolve(header: str, *, where: RequestSource, target: str
             ) -> tuple[Any, dict[str, ModelDeployment], dict[str, Any]]:
    """``authenticate_key``, with the tenant's granted deployments and the adapters it may use: from
    ``access_cache`` while the access generation read first is unchanged, else from the database (and
    kept, for an active key)."""
    scheme, _, raw = header.partition(" ")
    if scheme.lower() != "bearer" or not raw.strip():
        raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    key = raw.strip()
    key_digest = access_cache.digest(key)
    generation = access_generation.current(connection)  # read before the rows it vouches for
    entry = access_cache.get(key_digest, generation)
    if entry is not None:  # an active key, nothing changed since: valid keys are never throttled
        tenant_services.api_key_mark_used(api_key=entry.result.api_key)
        return entry.result, entry.deployments, entry.adapters
    retry_after = keyguard.api_key_retry_after(where=where)  # failures throttled, valid keys never
    result = (tenant_selectors.tenant_authenticate(key)
              if keyguard.api_key_worth_checking(key, retry_after=retry_after) else None)
    if result is None or result.status == "revoked":
        keyguard.api_key_rejected(where=where, key=key, target=target, retry_after=retry_after)
        raise Unauthenticated("invalid API key", code="invalid_api_key")
    if not result.ok:
        raise Forbidden("this tenant is suspended", code="tenant_suspended")
    tenant_services.api_key_mark_used(api_key=result.api_key)
    deployments = {d.name: d for d in _granted(result.tenant)}
    adapters = _usable_adapters(result.tenant)
    if generation is not None:
        access_cache.put(key_digest, access_cache.Entry(generation, result, deployments, adapters))
    return result, deployments, adapters


def authenticate(request: HttpRequest):
    """The tenant behind the request's bearer key (``authenticate_key``)."""
    return authenticate_key(request.headers.get("Authorization", ""), where=request_source(request),
                            target=f"{request.method} {request.path}").tenant


def admit(header: str, *, where: RequestSource, method: str, path: str) -> Admission:
    """Authenticate, count the request against ``requests_per_minute`` (429 past it) and bound its body:
    everything decided before the body is read, so requests refused later count too. A warm key: one
    read of the access generation; a cold one: the key lookup and the tenant's grants (which also
    resolve the request's model later)."""
    result, deployments, adapters = _resolve(header, where=where, target=f"{method} {path}")
    tenant = result.tenant
    try:
        ratelimit.count_request(tenant_id=tenant.pk, requests_per_minute=tenant.requests_per_minute)
    except ApplicationError as exc:
        exc.tenant_slug = tenant.slug  # whose refusal it is, for the serving metrics
        raise
    return Admission(tenant=tenant, deployments=deployments,
                     body_limit=body_limit_for(path, tenant, deployments.values(), method=method),
                     key_prefix=result.api_key.prefix, adapters=adapters)


def _gate_state(request: HttpRequest) -> Admission | Deferred | None:
    found = getattr(request, "scope", {}).get("state", {}).get(ADMISSION_STATE)
    return found if isinstance(found, (Admission, Deferred)) else None


def gate_admission(request: HttpRequest) -> Admission | None:
    """The ``Admission`` ``serving.gate`` left in the request's ASGI scope, if it admitted the request."""
    found = _gate_state(request)
    return found if isinstance(found, Admission) else None


def gated(request: HttpRequest) -> bool:
    """Did the request come through ``serving.gate`` (admitted there, or its admission deferred to the
    view)? Its database work then belongs on the serving database threads (``db_threads``)."""
    return _gate_state(request) is not None


def admitted(request: HttpRequest) -> Admission:
    """The request's ``Admission``: the gate's; for a request whose admission the gate deferred, made
    here, once (``Deferred``; a database failure is a retryable 503, as at the gate); for a request that
    did not come through the gate (WSGI, tests), made here."""
    found = _gate_state(request)
    if isinstance(found, Admission):
        return found
    if isinstance(found, Deferred):
        return found.admission or _admit_deferred(request, found)
    return _admit_request(request)


def key_header(authorization: str, api_key: str, path: str) -> str:
    """The ``Authorization`` value a request authenticates with: its own when it carries a bearer key;
    else, on ``API_KEY_PATHS``, its ``x-api-key`` as a bearer key (the same tenant key under the same
    checks and lockouts: another way to present it, never more access)."""
    scheme, _, raw = authorization.partition(" ")
    if scheme.lower() == "bearer" and raw.strip():
        return authorization
    if path.rstrip("/") in API_KEY_PATHS and api_key.strip():
        return "Bearer " + api_key.strip()
    return authorization


def _admit_request(request: HttpRequest) -> Admission:
    header = key_header(request.headers.get("Authorization", ""), request.headers.get("X-Api-Key", ""), request.path)
    return admit(header, where=request_source(request), method=request.method, path=request.path)


def _admit_deferred(request: HttpRequest, deferred: Deferred) -> Admission:
    try:
        deferred.admission = _admit_request(request)
    except ApplicationError as exc:
        if deferred.note is not None:
            deferred.note.tenant = getattr(exc, "tenant_slug", "")  # a quota refusal knows whose
        if exc.code == "rate_limit_requests" and deferred.on_refused is not None:
            deferred.on_refused(exc)
        raise
    except Exception:  # the database or cache is down: a retryable JSON error, never a bare 500
        log.exception("serving admission failed")
        raise Unavailable("the service is temporarily unavailable; retry shortly", retry_after=5,
                          code="service_unavailable") from None
    if deferred.note is not None:
        deferred.note.tenant = deferred.admission.tenant.slug
    return deferred.admission


def body_limit_for(path: str, tenant, deployments=None, *, method: str = "POST") -> int:
    """The most body a request to ``path`` may have for ``tenant``: what the largest prompt, token list
    or KV upload its granted models (``deployments``, with active revisions; looked up when None) allow
    can need (``bounds``), at most the path's limit; ``SMALL_JSON_BODY`` for a call that carries no
    prompt (a ``GET`` or ``DELETE``, a named cache's ``PATCH``). Checked before the body is read
    (``gate``, from Content-Length) or parsed."""
    route = path.rstrip("/")
    if method in BODYLESS_METHODS or route.startswith(CACHES_PATH + "/"):
        return min(SMALL_JSON_BODY, body_limit(path))
    limit = bounds.kv_store_body_limit if route == KV_STORE_PATH else (
        bounds.token_list_body_limit if route.startswith("/v1/kv/")
        else lambda facts: bounds.prompt_body_limit(facts, tenant.max_prompt_tokens))
    needed = [limit(model_facts(d)) for d in (_granted(tenant) if deployments is None else deployments)]
    return min(max(needed, default=bounds.BODY_SLACK), body_limit(path))


def _usable_adapters(tenant: Tenant) -> dict[str, Any]:
    """The LoRA adapters ``tenant`` may use, by name (``adapters.selectors.usable_for``: one query)."""
    from controlplane.adapters.selectors import usable_for

    return usable_for(tenant)


def _granted(tenant: Tenant) -> list[ModelDeployment]:
    """The deployments granted to ``tenant`` that have an active revision (loaded with it), in one query
    with no ordering and no grant columns: it runs on every request."""
    return list(ModelDeployment.objects.filter(grants__tenant=tenant, active_revision__isnull=False)
                .select_related("active_revision").order_by())

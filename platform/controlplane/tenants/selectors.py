"""Tenant reads, including what the serving API needs on every request.

Serving-path contract:

- ``tenant_authenticate(raw_key)`` -> ``AuthResult | None``: ``None`` = unknown key (answer 401);
  ``status == "revoked"`` = the key was revoked (401); ``"suspended"`` = the key is valid but the
  tenant is suspended or offboarded (403); ``"active"`` = go on (``result.ok``).
- ``tenant_scope_salt(tenant)`` -> 32 secret bytes for the cache namespace (the share group's when
  the tenant is a member). Never log, return or audit it.
- ``tenant_scope_fingerprint(tenant)`` -> short hex, the only form of the scope anything shows.
- ``grant_get_deployment(tenant, model_name)`` -> ``ModelDeployment | None``; ``None`` both for a
  model that does not exist and one not granted (answer both with the same 404).
- quotas: ``tenant.quotas`` (dict) or one column per quota of the registry
  (``controlplane.tenants.quotas.QUOTAS``: what a ``None`` means, unlimited or a worker default).
- cache policy: ``tenant.persist_kv`` (may KV go to L3 at all), ``tenant.retention_seconds``.
- ``data_key_for_worker(tenant)`` -> the tenant's wrapped data keys for its worker request
  (``controlplane.tenants.keystore``); ``data_key_list`` / ``data_key_get`` -> versions and states.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from django.db.models import QuerySet

from controlplane.common.errors import NotFound
from controlplane.common.tokens import secret_matches, secret_prefix
from controlplane.registry.models import ModelDeployment
from controlplane.tenants.keystore import data_key_for_worker, data_key_get, data_key_list  # noqa: F401
from controlplane.tenants.models import ApiKey, Grant, ShareGroup, Tenant

FINGERPRINT_DOMAIN = b"strata/scope-fingerprint/v1\x00"


@dataclass(frozen=True)
class AuthResult:
    tenant: Tenant
    api_key: ApiKey
    status: str  # "active" | "suspended" | "revoked"

    @property
    def ok(self) -> bool:
        return self.status == "active"


def tenant_authenticate(raw_key: str) -> AuthResult | None:
    """Find the key by its visible prefix, then compare SHA-256 digests in constant time."""
    if not isinstance(raw_key, str) or not raw_key:
        return None
    candidates = list(
        ApiKey.objects.filter(prefix=secret_prefix(raw_key)).select_related("tenant", "tenant__share_group")
    )
    match = None
    for key in candidates or [None]:
        if secret_matches(raw_key, key.key_hash if key else None) and match is None:
            match = key
    if match is None:
        return None
    if match.revoked_at is not None:
        return AuthResult(tenant=match.tenant, api_key=match, status="revoked")
    if match.tenant.status != Tenant.Status.ACTIVE:
        return AuthResult(tenant=match.tenant, api_key=match, status="suspended")
    return AuthResult(tenant=match.tenant, api_key=match, status="active")


def tenant_scope_salt(tenant: Tenant) -> bytes:
    """The secret salt that scopes ``tenant``'s cache: its share group's if it is in one."""
    source = tenant.share_group if tenant.share_group_id else tenant
    return bytes(source.scope_salt)


def scope_fingerprint(salt: bytes) -> str:
    """16 hex chars of a domain-separated SHA-256 of the salt: identifies a scope, reveals nothing."""
    return hashlib.sha256(FINGERPRINT_DOMAIN + bytes(salt)).hexdigest()[:16]


def tenant_scope_fingerprint(tenant: Tenant) -> str:
    return scope_fingerprint(tenant_scope_salt(tenant))


def grant_get_deployment(tenant: Tenant, model_name: str) -> ModelDeployment | None:
    """The deployment ``model_name`` if ``tenant`` is granted it, else ``None`` (unknown or not
    granted: indistinguishable on purpose)."""
    return (
        ModelDeployment.objects.select_related("active_revision")
        .filter(name=model_name, grants__tenant=tenant)
        .first()
    )


def tenant_list(*, status: str | None = None) -> QuerySet[Tenant]:
    qs = Tenant.objects.select_related("share_group")
    return qs.filter(status=status) if status else qs


def tenant_get(*, slug: str) -> Tenant:
    """Raises NotFound."""
    tenant = Tenant.objects.select_related("share_group").filter(slug=slug).first()
    if tenant is None:
        raise NotFound(f"tenant {slug!r} not found", code="tenant_not_found")
    return tenant


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant)


def api_key_get(*, tenant: Tenant, key_id: int) -> ApiKey:
    """Raises NotFound (also for another tenant's key)."""
    key = ApiKey.objects.filter(tenant=tenant, pk=key_id).first()
    if key is None:
        raise NotFound(f"tenant {tenant.slug!r} has no key {key_id}", code="key_not_found")
    return key


def grant_list(*, tenant: Tenant) -> QuerySet[Grant]:
    return Grant.objects.filter(tenant=tenant, deployment__deleted_at__isnull=True).select_related("deployment")


def share_group_list() -> QuerySet[ShareGroup]:
    return ShareGroup.objects.prefetch_related("members").order_by("slug")


def share_group_get(*, slug: str) -> ShareGroup:
    """Raises NotFound."""
    group = share_group_list().filter(slug=slug).first()
    if group is None:
        raise NotFound(f"share group {slug!r} not found", code="share_group_not_found")
    return group

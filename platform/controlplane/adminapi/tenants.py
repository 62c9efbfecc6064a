"""/api/admin/tenants: create, list, read, change (name, status, quotas, cache policy), offboard.

The data-key routes (``tenants/{slug}/data-keys``) live in ``datakeys.py``, mounted beside this
router by ``api.py`` (nested here, each would be listed twice in the docs: under both tags)."""

from __future__ import annotations

from typing import Any

from ninja import Router, Status

from controlplane.adminapi.auth import actor_of
from controlplane.adminapi.present import tenant_out as base_tenant_out
from controlplane.adminapi.schemas import OffboardOut, TenantCreateIn, TenantOut, TenantPatchIn
from controlplane.common.query import QueryText
from controlplane.tenants import selectors, services
from controlplane.tenants.models import Tenant

router = Router(tags=["tenants"])


def tenant_out(tenant: Tenant) -> dict[str, Any]:
    return {**base_tenant_out(tenant), "cache_policy": tenant.cache_policy}


@router.post("tenants", response={201: TenantOut})
def create_tenant(request, payload: TenantCreateIn):
    quotas = payload.quotas.model_dump(exclude_unset=True) if payload.quotas else None
    tenant = services.tenant_create(actor=actor_of(request), slug=payload.slug, name=payload.name, quotas=quotas)
    return Status(201, tenant_out(tenant))


@router.get("tenants", response=list[TenantOut])
def list_tenants(request, status: QueryText | None = None):
    return [tenant_out(t) for t in selectors.tenant_list(status=status)]


@router.get("tenants/{slug}", response=TenantOut)
def get_tenant(request, slug: str):
    return tenant_out(selectors.tenant_get(slug=slug))


@router.patch("tenants/{slug}", response=TenantOut)
def update_tenant(request, slug: str, payload: TenantPatchIn):
    """``cache_policy``: ``{"persist": bool, "retention_seconds": 0..31536000}``, each optional
    (omitted = unchanged); audited ``tenant.cache_policy``."""
    tenant = services.tenant_update(
        actor=actor_of(request),
        tenant=selectors.tenant_get(slug=slug),
        name=payload.name,
        status=payload.status,
        quotas=payload.quotas.model_dump(exclude_unset=True) if payload.quotas else None,
        cache_policy=payload.cache_policy.model_dump(exclude_unset=True) if payload.cache_policy else None,
        reason=payload.reason,
    )
    return tenant_out(selectors.tenant_get(slug=tenant.slug))


@router.delete("tenants/{slug}", response=OffboardOut)
def offboard_tenant(request, slug: str, reason: str = ""):
    """Offboard: keys revoked at once; one ``offboard`` job flushes the tenant's caches everywhere and
    crypto-shreds every version of its data key (see ``flush_job`` for its progress)."""
    result = services.tenant_offboard(actor=actor_of(request), tenant=selectors.tenant_get(slug=slug), reason=reason)
    job = result.flush_job
    return {
        "tenant": tenant_out(selectors.tenant_get(slug=slug)),
        "keys_revoked": result.keys_revoked,
        "flush_job": {"id": job.pk, "status": str(getattr(job, "status", ""))} if job is not None else None,
    }

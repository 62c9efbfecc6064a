"""/api/admin/tenants: create, list, read, change, offboard."""

from __future__ import annotations

from ninja import Router, Status

from controlplane.adminapi.auth import actor_of
from controlplane.adminapi.present import tenant_out
from controlplane.adminapi.schemas import OffboardOut, TenantCreateIn, TenantOut, TenantPatchIn
from controlplane.tenants import selectors, services

router = Router(tags=["tenants"])


@router.post("tenants", response={201: TenantOut})
def create_tenant(request, payload: TenantCreateIn):
    quotas = payload.quotas.model_dump(exclude_unset=True) if payload.quotas else None
    tenant = services.tenant_create(actor=actor_of(request), slug=payload.slug, name=payload.name, quotas=quotas)
    return Status(201, tenant_out(tenant))


@router.get("tenants", response=list[TenantOut])
def list_tenants(request, status: str | None = None):
    return [tenant_out(t) for t in selectors.tenant_list(status=status)]


@router.get("tenants/{slug}", response=TenantOut)
def get_tenant(request, slug: str):
    return tenant_out(selectors.tenant_get(slug=slug))


@router.patch("tenants/{slug}", response=TenantOut)
def update_tenant(request, slug: str, payload: TenantPatchIn):
    tenant = services.tenant_update(
        actor=actor_of(request),
        tenant=selectors.tenant_get(slug=slug),
        name=payload.name,
        status=payload.status,
        quotas=payload.quotas.model_dump(exclude_unset=True) if payload.quotas else None,
        reason=payload.reason,
    )
    return tenant_out(selectors.tenant_get(slug=tenant.slug))


@router.delete("tenants/{slug}", response=OffboardOut)
def offboard_tenant(request, slug: str, reason: str = ""):
    result = services.tenant_offboard(actor=actor_of(request), tenant=selectors.tenant_get(slug=slug), reason=reason)
    job = result.flush_job
    return {
        "tenant": tenant_out(selectors.tenant_get(slug=slug)),
        "keys_revoked": result.keys_revoked,
        "flush_job": {"id": job.pk, "status": str(getattr(job, "status", ""))} if job is not None else None,
    }

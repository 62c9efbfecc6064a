"""/api/admin/tenants/{slug}/grants: which models a tenant may use."""

from __future__ import annotations

from ninja import Router, Status

from controlplane.adminapi.auth import actor_of
from controlplane.adminapi.schemas import GrantIn, GrantOut
from controlplane.registry.selectors import model_get
from controlplane.tenants import access, selectors

router = Router(tags=["grants"])


@router.post("tenants/{slug}/grants", response={201: GrantOut})
def create_grant(request, slug: str, payload: GrantIn):
    grant = access.grant_create(
        actor=actor_of(request), tenant=selectors.tenant_get(slug=slug), deployment=model_get(name=payload.model)
    )
    return Status(201, {"model": grant.deployment.name, "created": grant.created})


@router.get("tenants/{slug}/grants", response=list[GrantOut])
def list_grants(request, slug: str):
    grants = selectors.grant_list(tenant=selectors.tenant_get(slug=slug))
    return [{"model": g.deployment.name, "created": g.created} for g in grants]


@router.delete("tenants/{slug}/grants/{model}", response={204: None})
def delete_grant(request, slug: str, model: str):
    access.grant_delete(
        actor=actor_of(request), tenant=selectors.tenant_get(slug=slug), deployment=model_get(name=model)
    )
    return Status(204, None)

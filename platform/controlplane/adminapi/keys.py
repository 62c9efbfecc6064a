"""/api/admin/tenants/{slug}/keys: create (the key is in this one response), list, revoke."""

from __future__ import annotations

from ninja import Router, Status

from controlplane.adminapi.auth import actor_of
from controlplane.adminapi.present import key_out
from controlplane.adminapi.schemas import KeyCreatedOut, KeyCreateIn, KeyOut
from controlplane.tenants import selectors, services

router = Router(tags=["keys"])


@router.post("tenants/{slug}/keys", response={201: KeyCreatedOut})
def create_key(request, slug: str, payload: KeyCreateIn | None = None):
    tenant = selectors.tenant_get(slug=slug)
    key, raw = services.api_key_create(actor=actor_of(request), tenant=tenant, name=payload.name if payload else "")
    return Status(201, {"id": key.pk, "key": raw, "prefix": key.prefix, "name": key.name, "created": key.created})


@router.get("tenants/{slug}/keys", response=list[KeyOut])
def list_keys(request, slug: str):
    return [key_out(k) for k in selectors.api_key_list(tenant=selectors.tenant_get(slug=slug))]


@router.delete("tenants/{slug}/keys/{key_id}", response=KeyOut)
def revoke_key(request, slug: str, key_id: int):
    key = selectors.api_key_get(tenant=selectors.tenant_get(slug=slug), key_id=key_id)
    return key_out(services.api_key_revoke(actor=actor_of(request), api_key=key))

"""/api/admin/tenants/{slug}/caches: an operator's view of a tenant's named caches (counts, tiers,
expiry; never their tokens), and their deletion (audited as the operator)."""

from __future__ import annotations

from ninja import Router

from controlplane.adminapi.auth import actor_of
from controlplane.caches import residency, selectors, services
from controlplane.caches.api import present
from controlplane.common.errors import NotFound
from controlplane.tenants import selectors as tenant_selectors

router = Router(tags=["caches"])


@router.get("tenants/{slug}/caches", response=list[dict])
def list_caches(request, slug: str):
    tenant = tenant_selectors.tenant_get(slug=slug)
    caches = list(selectors.caches_live(tenant))
    now = residency.now_for(caches)  # asked from the replicas, within residency.ASK_TIMEOUT_S
    return [{**present(c, now[c.pk]), "key_prefix": c.key_prefix} for c in caches]


@router.delete("tenants/{slug}/caches/{cache_id}", response=dict)
def delete_cache(request, slug: str, cache_id: str, reason: str = ""):
    tenant = tenant_selectors.tenant_get(slug=slug)
    cache = selectors.cache_get(tenant, cache_id)
    if cache is None:
        raise NotFound(f"tenant {slug!r} has no cache {cache_id!r}", code="cache_not_found")
    result = services.cache_delete(cache, actor=actor_of(request), reason=reason or "deleted by an operator")
    return {"id": cache_id, "deleted": True, "tiers": result["tiers"], "bytes": result["bytes"]}

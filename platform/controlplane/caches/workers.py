"""A named cache on the replicas: the worker request that names its prefix, and the calls that pin,
unpin and delete it on every replica of its model (``cache_pin`` / ``cache_drop``, the engine
contract's). Blocking (``gateway.call``): called from sync threads."""

from __future__ import annotations

import logging

from controlplane.caches.models import NamedCache
from controlplane.common.errors import Unavailable
from controlplane.runtime import gateway
from controlplane.tenants import quotas
from controlplane.tenants import selectors as tenant_selectors
from workers.protocol import TIERS, WorkerRequest

logger = logging.getLogger("controlplane.caches")


def cache_request(cache: NamedCache) -> dict:
    """The worker request that names ``cache``'s prefix (its hashes are the worker's own, in the
    tenant's scope, as a completion of that prefix computes them)."""
    tenant = cache.tenant
    return WorkerRequest(
        tenant=str(tenant.pk), scope_salt=tenant_selectors.tenant_scope_salt(tenant), prompt=list(cache.token_ids),
        cache_salt=cache.cache_salt, max_tokens=1, **quotas.worker_values(tenant, "cache"),
        persist=bool(tenant.persist_kv and tenant.retention_seconds > 0), retention_seconds=tenant.retention_seconds,
        tenant_retention_seconds=tenant.retention_seconds, data_key=tenant_selectors.data_key_for_worker(tenant),
    ).to_dict()


def _each_replica(cache: NamedCache, method: str, *args, skip: frozenset[int] = frozenset()) -> list[dict | None]:
    spec = gateway.spec_for(cache.deployment)
    out = []
    for index in gateway.replica_set(spec).indices():
        if index in skip:
            continue
        try:
            out.append(gateway.call(spec, method, *args, create=False, replica=index))
        except Unavailable as exc:
            logger.warning("%s of %s on replica %s failed: %s", method, cache.public_id, index, exc.message)
            out.append(None)
    return out


def pin_everywhere(cache: NamedCache, until: float | None, *, skip: frozenset[int] = frozenset()) -> int:
    """(Re)pin ``cache`` until ``until`` (None: unpin) on every running replica; how many answered."""
    return sum(1 for r in _each_replica(cache, "cache_pin", cache_request(cache), until, skip=skip) if r is not None)


def drop_everywhere(cache: NamedCache) -> dict:
    """Delete ``cache``'s blocks from every tier of every running replica. ``ok``: at least one replica
    answered (L3 is shared by the replicas: one delete removes its objects); with none running, only
    when the tenant never persists (L1 and L2 ended with the replicas), else the caller retries."""
    results = _each_replica(cache, "cache_drop", cache_request(cache))
    answered = [r for r in results if r is not None]
    tiers = {t: sum(int((r.get("tiers") or {}).get(t, 0)) for r in answered) for t in TIERS}
    persists = bool(cache.tenant.persist_kv and cache.tenant.retention_seconds > 0)
    ok = bool(answered) or (not results and not persists)
    return {"ok": ok, "tiers": tiers, "bytes": sum(int(r.get("bytes", 0)) for r in answered),
            "replicas": len(answered)}

"""A named cache on the replicas: the worker request that names its prefix, and the calls that pin,
unpin and delete it on every replica of its model (``cache_pin`` / ``cache_drop``, the engine
contract's). Blocking (``gateway.call``): called from sync threads.

What the calls need is read from the database once (``target``: its model's worker spec, the worker
request): ``pin_everywhere`` and ``drop_everywhere`` given a ``Target`` make Ray calls only, so the
serving views run them off the serving database threads (a slow replica holds no thread that other
tenants' admissions wait for); given a ``NamedCache`` they read it first, in the calling thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from controlplane.adapters.selectors import AdapterRef
from controlplane.caches.models import NamedCache
from controlplane.common.errors import Unavailable
from controlplane.runtime import gateway
from controlplane.tenants import quotas
from controlplane.tenants import selectors as tenant_selectors
from workers.protocol import TIERS, WorkerRequest

logger = logging.getLogger("controlplane.caches")


@dataclass(frozen=True)
class Target:
    """What the replicas' calls about one named cache need: its id (for the logs), its model's worker
    spec, the worker request that names its prefix (``cache_request``) and whether its tenant's KV
    persists in L3 (a delete with no replica running is complete only when it does not)."""

    public_id: str
    spec: gateway.WorkerSpec
    req: dict
    persists: bool


def cache_request(cache: NamedCache) -> dict:
    """The worker request that names ``cache``'s prefix (its hashes are the worker's own, in the
    tenant's scope, as a completion of that prefix computes them)."""
    tenant = cache.tenant
    return WorkerRequest(
        tenant=str(tenant.pk), scope_salt=tenant_selectors.tenant_scope_salt(tenant), prompt=list(cache.token_ids),
        cache_salt=cache.cache_salt, max_tokens=1, **quotas.worker_values(tenant, "cache"),
        persist=bool(tenant.persist_kv and tenant.retention_seconds > 0), retention_seconds=tenant.retention_seconds,
        tenant_retention_seconds=tenant.retention_seconds, data_key=tenant_selectors.data_key_for_worker(tenant),
        lora=AdapterRef.of(cache.adapter).to_worker() if cache.adapter_id else None,  # the adapter's scope
    ).to_dict()


def target(cache: NamedCache) -> Target:
    """``cache``'s ``Target``, read from the database (its tenant, scope, data keys and model)."""
    tenant = cache.tenant
    return Target(public_id=cache.public_id, spec=gateway.spec_for(cache.deployment), req=cache_request(cache),
                  persists=bool(tenant.persist_kv and tenant.retention_seconds > 0))


def _target(cache: NamedCache | Target) -> Target:
    return cache if isinstance(cache, Target) else target(cache)


def _each_replica(where: Target, method: str, *args, skip: frozenset[int] = frozenset()) -> list[dict | None]:
    out = []
    for index in gateway.replica_set(where.spec).indices():
        if index in skip:
            continue
        try:
            out.append(gateway.call(where.spec, method, *args, create=False, replica=index))
        except Unavailable as exc:
            logger.warning("%s of %s on replica %s failed: %s", method, where.public_id, index, exc.message)
            out.append(None)
    return out


def pin_everywhere(cache: NamedCache | Target, until: float | None, *, skip: frozenset[int] = frozenset()) -> int:
    """(Re)pin ``cache`` until ``until`` (None: unpin) on every running replica; how many answered."""
    where = _target(cache)
    return sum(1 for r in _each_replica(where, "cache_pin", where.req, until, skip=skip) if r is not None)


def drop_everywhere(cache: NamedCache | Target) -> dict:
    """Delete ``cache``'s blocks from every tier of every running replica. ``ok``: at least one replica
    answered (L3 is shared by the replicas: one delete removes its objects); with none running, only
    when the tenant never persists (L1 and L2 ended with the replicas), else the caller retries."""
    where = _target(cache)
    results = _each_replica(where, "cache_drop", where.req)
    answered = [r for r in results if r is not None]
    tiers = {t: sum(int((r.get("tiers") or {}).get(t, 0)) for r in answered) for t in TIERS}
    ok = bool(answered) or (not results and not where.persists)
    return {"ok": ok, "tiers": tiers, "bytes": sum(int(r.get("bytes", 0)) for r in answered),
            "replicas": len(answered)}

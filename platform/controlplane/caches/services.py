"""Writes of named caches: create (after the worker's prewarm), change the TTL, delete (the bytes, from
every tier of every replica). Every change is audited with the tenant key's prefix (tenant calls) or
the operator (console, admin API, offboarding), never with the tokens.

A named cache is a soft pin: its full blocks are protected from eviction in L2 and L3 until it
expires, as far as the tenant's ``max_pinned_tokens`` reaches (whole caches: a cache that does not fit
what is left is created unpinned, ``pinned_tokens`` 0; the check and the insert are one atomic step,
``cache_create``, so concurrent creates cannot pin more than the quota between them); the worker's
eviction never lets a pin take another tenant below its fair share. When the TTL ends the pin decays
and the blocks are ordinary cached blocks again; the row stays (the ledger bills the pinned
token-hours from its counts and times) but is no longer listed, and ``caches_sweep`` (run every
``STRATA_L3_SWEEP_SECONDS``, the L3 retention sweep's period: ``caches.sweeper``) clears its token
ids and messages, as a delete does at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.adapters.models import Adapter
from controlplane.audit.services import audit_record
from controlplane.caches.models import NamedCache
from controlplane.caches.selectors import pinned_tokens_in_use
from controlplane.common.actor import Actor
from controlplane.common.errors import InvalidInput, NotFound, Unavailable
from controlplane.tenants.models import Tenant

logger = logging.getLogger("controlplane.caches")

TTL_DEFAULT = 3600
TTL_MIN = 60
TTL_MAX = 30 * 86_400


def ttl_limit(tenant) -> int:
    """The longest TTL ``tenant`` may give a named cache: its retention when its KV persists (L3
    objects are not kept longer), else a day (host memory only)."""
    if tenant.persist_kv and tenant.retention_seconds > 0:
        return min(TTL_MAX, tenant.retention_seconds)
    return 86_400


def check_ttl(tenant, ttl_seconds: int) -> int:
    limit = ttl_limit(tenant)
    if not TTL_MIN <= ttl_seconds <= limit:
        raise InvalidInput(f"ttl_seconds must be between {TTL_MIN} and {limit} for this tenant",
                           code="invalid_ttl")
    return ttl_seconds


def cache_create(*, tenant, deployment, revision: str, kind: str, token_ids: list[int], messages, cache_salt,
                 display_name: str, ttl_seconds: int, pin_tokens: int, tiers: dict, key_prefix: str,
                 actor: Actor, block_size: int = 16, adapter_id: int | None = None) -> NamedCache:
    """The row of a cache the worker has prewarmed, audited. It is pinned (``pinned_tokens``:
    ``pin_tokens``, its full-block tokens) when the tenant's ``max_pinned_tokens``, as it is now, has
    room for all of them beside its live pinned caches, else not at all (0). The room is read and the
    row inserted in one transaction that holds the tenant's row locked (``SELECT ... FOR UPDATE`` on
    PostgreSQL; on SQLite every transaction takes the write lock when it begins, ``transaction_mode``
    IMMEDIATE): concurrent creates of one tenant take turns, so their pins never add up past the quota."""
    with transaction.atomic():
        locked = Tenant.objects.select_for_update().only("pk", "max_pinned_tokens").get(pk=tenant.pk)
        room = int(locked.max_pinned_tokens or 0) - pinned_tokens_in_use(tenant)
        pinned = pin_tokens if 0 < pin_tokens <= room else 0
        cache = NamedCache.objects.create(
            tenant=tenant, deployment=deployment, revision=revision, adapter_id=adapter_id, kind=kind,
            token_ids=token_ids,
            messages=messages, cache_salt=cache_salt, display_name=display_name, tokens=len(token_ids),
            pinned_tokens=pinned, tiers=tiers, tiers_at=timezone.now(), key_prefix=key_prefix, block_size=block_size,
            expires_at=timezone.now() + timedelta(seconds=ttl_seconds))
        if adapter_id is not None:  # loaded here, on the database thread: the answer names it
            cache.adapter = Adapter.objects.only("name").get(pk=adapter_id)
        audit_record(actor=actor, action="cache.create", target=cache.public_id, tenant=tenant.slug,
                     new={"model": deployment.name, **({"adapter": cache.adapter.name} if adapter_id else {}),
                          "tokens": cache.tokens, "pinned_tokens": pinned,
                          "ttl_seconds": ttl_seconds, "key_prefix": key_prefix})
    return cache


def cache_set_ttl(cache: NamedCache, *, ttl_seconds: int, actor: Actor, key_prefix: str = "") -> NamedCache:
    """Extend or shorten ``cache`` to expire ``ttl_seconds`` from now, audited; the caller moves the pin
    on the workers (``workers.pin_everywhere``) when it has one. 404 when the cache is no longer live
    (it expired or was deleted since it was read: a sweep may have cleared its tokens, and it does not
    come back)."""
    check_ttl(cache.tenant, ttl_seconds)
    old = cache.expires_at
    now = timezone.now()
    expires_at = now + timedelta(seconds=ttl_seconds)
    with transaction.atomic():
        moved = NamedCache.objects.filter(pk=cache.pk, deleted_at__isnull=True, expires_at__gt=now).update(
            expires_at=expires_at, updated=now)
        if not moved:
            raise NotFound(f"cache '{cache.public_id}' does not exist", code="cache_not_found")
        cache.expires_at = expires_at
        audit_record(actor=actor, action="cache.extend", target=cache.public_id, tenant=cache.tenant.slug,
                     old={"expires_at": old.isoformat()},
                     new={"expires_at": cache.expires_at.isoformat(), "key_prefix": key_prefix})
    return cache


def cache_delete(cache: NamedCache, *, actor: Actor, reason: str = "", key_prefix: str = "") -> dict:
    """Delete ``cache``'s bytes from every tier of every replica of its model, then the row's tokens;
    audited. 503 (nothing changed, retry) when no replica could delete from L3."""
    from controlplane.caches import workers

    return cache_deleted(cache, results=workers.drop_everywhere(cache), actor=actor, reason=reason,
                         key_prefix=key_prefix)


def cache_deleted(cache: NamedCache, *, results: dict, actor: Actor, reason: str = "", key_prefix: str = "") -> dict:
    """``cache_delete`` once the replicas answered (``workers.drop_everywhere``'s ``results``): 503
    (nothing changed, retry) unless they deleted it everywhere, else the row's tokens cleared and the
    deletion audited. Returns ``results``."""
    if not results["ok"]:
        raise Unavailable("the cache could not be deleted from every tier now; retry shortly", retry_after=5)
    _mark_deleted(cache)
    with transaction.atomic():
        cache.deleted_at = timezone.now()
        cache.token_ids, cache.messages = [], None
        cache.save(update_fields=["deleted_at", "token_ids", "messages", "updated"])
        audit_record(actor=actor, action="cache.delete", target=cache.public_id, tenant=cache.tenant.slug,
                     reason=reason, new={"deleted": results["tiers"], "key_prefix": key_prefix})
    return results


def _mark_deleted(cache: NamedCache) -> None:
    """Its blocks' later misses read ``deleted`` in the tenant's diagnostics (once the history holds
    every request answered before: ``serving.accountant`` books them off their response path)."""
    from controlplane.caches import history
    from controlplane.serving import accountant

    accountant.drain()

    key = history.scope_key(bytes(cache.tenant.scope_salt), cache.deployment.name, cache.cache_salt)
    history.HISTORY.mark_deleted((str(cache.tenant_id), cache.deployment.name, cache.cache_salt or ""),
                                 history.digests(key, list(cache.token_ids), cache.block_size), cache.public_id)


def caches_forget_tenant(tenant) -> int:
    """Offboarding and shredding: the tenant's caches end (their bytes go with the tenant's flush and
    shred jobs); their tokens are cleared at once, and this process's diagnostics history drops the
    tenant's share (another web process's ages out of its own). Returns how many."""
    from controlplane.caches import history

    history.HISTORY.forget_tenant(str(tenant.pk))
    now = timezone.now()
    return (NamedCache.objects.filter(tenant=tenant, deleted_at__isnull=True)
            .update(deleted_at=now, token_ids=[], messages=None, updated=now))


def caches_forget_deployment(deployment) -> int:
    """A model is deleted: its named caches end at once (their bytes go with the model's delete job),
    their tokens cleared. Returns how many."""
    now = timezone.now()
    return (NamedCache.objects.filter(deployment=deployment, deleted_at__isnull=True)
            .update(deleted_at=now, token_ids=[], messages=None, updated=now))


SWEEP_ACTOR = Actor.system("caches.sweep")
SWEEP_BATCH = 500  # rows cleared per UPDATE (SQLite bounds the parameters of one statement)


@dataclass(frozen=True)
class SweepResult:
    """What one ``caches_sweep`` cleared: ``caches`` rows (``expired`` and ``deleted`` of them),
    holding ``tokens`` token ids, of ``tenants`` tenants."""

    caches: int = 0
    expired: int = 0
    deleted: int = 0
    tokens: int = 0
    tenants: int = 0


def caches_sweep(*, now: datetime | None = None, actor: Actor = SWEEP_ACTOR) -> SweepResult:
    """Clear the token ids and messages (the tenant's prompt) of every named cache that has expired or
    was deleted, keeping its counts, times and pin (the ledger bills pinned token-hours from them).
    One audit event for the whole sweep when it cleared any (``cache.sweep``: the counts, never a
    token). Idempotent; concurrent sweeps clear each row once (its lock, then the condition again)."""
    now = now or timezone.now()
    stale = (NamedCache.objects.filter(Q(expires_at__lte=now) | Q(deleted_at__isnull=False))
             .filter(~Q(token_ids=[]) | Q(messages__isnull=False)))
    with transaction.atomic():
        rows = list(stale.select_for_update().order_by("pk")
                    .values_list("pk", "tenant_id", "tokens", "deleted_at"))
        if not rows:
            return SweepResult()
        for start in range(0, len(rows), SWEEP_BATCH):
            NamedCache.objects.filter(pk__in=[r[0] for r in rows[start:start + SWEEP_BATCH]]).update(
                token_ids=[], messages=None, updated=now)
        deleted = sum(1 for r in rows if r[3] is not None)
        result = SweepResult(caches=len(rows), expired=len(rows) - deleted, deleted=deleted,
                             tokens=sum(r[2] for r in rows), tenants=len({r[1] for r in rows}))
        audit_record(actor=actor, action="cache.sweep", reason="expired and deleted named caches lose their tokens",
                     new={"caches": result.caches, "expired": result.expired, "deleted": result.deleted,
                          "tokens": result.tokens, "tenants": result.tenants})
    logger.info("named-cache sweep cleared %d caches (%d tokens)", result.caches, result.tokens)
    return result

"""Writes of named caches: create (after the worker's prewarm), change the TTL, delete (the bytes, from
every tier of every replica). Every change is audited with the tenant key's prefix (tenant calls) or
the operator (console, admin API, offboarding), never with the tokens.

A named cache is a soft pin: its full blocks are protected from eviction in L2 and L3 until it
expires, as far as the tenant's ``max_pinned_tokens`` reaches (whole caches: a cache that does not fit
what is left is created unpinned, ``pinned_tokens`` 0; the check and the insert are one atomic step,
``cache_create``, so concurrent creates cannot pin more than the quota between them); the worker's
eviction never lets a pin take another tenant below its fair share. When the TTL ends the pin decays
and the blocks are ordinary cached blocks again; the row stays (the ledger bills the pinned
token-hours) but is no longer listed.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.caches.models import NamedCache
from controlplane.caches.selectors import pinned_tokens_in_use
from controlplane.common.actor import Actor
from controlplane.common.errors import InvalidInput, Unavailable
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
                 actor: Actor, block_size: int = 16) -> NamedCache:
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
            tenant=tenant, deployment=deployment, revision=revision, kind=kind, token_ids=token_ids,
            messages=messages, cache_salt=cache_salt, display_name=display_name, tokens=len(token_ids),
            pinned_tokens=pinned, tiers=tiers, key_prefix=key_prefix, block_size=block_size,
            expires_at=timezone.now() + timedelta(seconds=ttl_seconds))
        audit_record(actor=actor, action="cache.create", target=cache.public_id, tenant=tenant.slug,
                     new={"model": deployment.name, "tokens": cache.tokens, "pinned_tokens": pinned,
                          "ttl_seconds": ttl_seconds, "key_prefix": key_prefix})
    return cache


def cache_set_ttl(cache: NamedCache, *, ttl_seconds: int, actor: Actor, key_prefix: str = "") -> NamedCache:
    """Extend or shorten ``cache`` to expire ``ttl_seconds`` from now, audited; the caller moves the pin
    on the workers (``workers.pin_everywhere``) when it has one."""
    check_ttl(cache.tenant, ttl_seconds)
    old = cache.expires_at
    cache.expires_at = timezone.now() + timedelta(seconds=ttl_seconds)
    with transaction.atomic():
        cache.save(update_fields=["expires_at", "updated"])
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
    shred jobs); their tokens are cleared at once. Returns how many."""
    now = timezone.now()
    return (NamedCache.objects.filter(tenant=tenant, deleted_at__isnull=True)
            .update(deleted_at=now, token_ids=[], messages=None, updated=now))


"""Reads of named caches, always within one tenant (another tenant's id reads as missing)."""

from __future__ import annotations

from django.db.models import QuerySet
from django.utils import timezone

from controlplane.caches.models import NamedCache


def caches_live(tenant) -> QuerySet[NamedCache]:
    """``tenant``'s named caches that are neither deleted nor expired, newest first."""
    return (NamedCache.objects.filter(tenant=tenant, deleted_at__isnull=True, expires_at__gt=timezone.now())
            .select_related("deployment", "adapter__deployment"))


def cache_get(tenant, public_id: str) -> NamedCache | None:
    """``tenant``'s live named cache ``public_id``, or None (missing, expired, deleted, or another's)."""
    return caches_live(tenant).filter(public_id=public_id).first()


def pinned_tokens_in_use(tenant, *, exclude: int | None = None) -> int:
    """Tokens ``tenant``'s live named caches hold pinned (what ``max_pinned_tokens`` bounds)."""
    rows = caches_live(tenant).filter(pinned_tokens__gt=0)
    if exclude is not None:
        rows = rows.exclude(pk=exclude)
    return sum(rows.values_list("pinned_tokens", flat=True))

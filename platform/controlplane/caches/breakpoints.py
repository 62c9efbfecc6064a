"""Anthropic ``cache_control`` breakpoints kept as soft pins (``POST /v1/messages``).

The prompt up to a breakpoint is pinned like a named cache, and as one: a ``NamedCache`` row of kind
``KIND`` (its full-block token ids, ``pinned_tokens``, ``expires_at``), so the tenant's
``max_pinned_tokens`` bounds breakpoints and named caches together, the pins follow restarted replicas
(``repin``), the ledger bills their token-hours, the sweep clears their tokens once they expire and
offboarding ends them. The row's ``display_name`` names the prefix by a digest (revision, cache salt,
token ids), so a breakpoint used again finds its row and moves its expiry (Anthropic refreshes a
cache entry's TTL on every use) instead of pinning the same tokens twice.

``breakpoints_pin`` decides, in one transaction holding the tenant's row locked (as ``cache_create``
does), from the deepest breakpoint to the shallowest: a prefix already pinned by a deeper breakpoint
of the request for at least as long is covered by it; a live row is extended; a new one is pinned when
the room left has all its full-block tokens, else the breakpoint is served unpinned (``not_pinned``).
A TTL is ``ttl_seconds * STRATA_CACHE_CONTROL_TTL_SCALE`` (1 in production; tests scale it down).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction

from controlplane.audit.services import audit_record
from controlplane.caches import workers
from controlplane.caches.models import NamedCache
from controlplane.caches.selectors import caches_live, pinned_tokens_in_use
from controlplane.common.actor import Actor
from controlplane.tenants.models import Tenant

KIND = "prefix"
LABEL = "cache_control "


@dataclass(frozen=True)
class Mark:
    """A breakpoint to keep: the prompt's first ``tokens`` for ``ttl_seconds`` (``ttl``: "5m" / "1h")."""

    tokens: int
    ttl: str
    ttl_seconds: int


@dataclass(frozen=True)
class Kept:
    """What became of one breakpoint: ``status`` ``pinned`` (by its own row or a deeper breakpoint's),
    ``not_pinned`` (no room left under ``max_pinned_tokens``) or ``too_short`` (no full block);
    ``pinned_tokens``: the full-block tokens held; ``expires_at``: unix time of the pin's end."""

    tokens: int
    ttl: str
    status: str
    pinned_tokens: int = 0
    expires_at: float | None = None

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "ttl": self.ttl, "status": self.status, "pinned_tokens": self.pinned_tokens,
                "expires_at": None if self.expires_at is None else int(self.expires_at)}


def _label(revision: str, cache_salt: str | None, prefix: list[int]) -> str:
    h = hashlib.sha256(f"{revision}\0{cache_salt or ''}\0".encode())
    h.update(",".join(map(str, prefix)).encode())
    return LABEL + h.hexdigest()[:48]


def ttl_scale() -> float:
    return float(getattr(settings, "STRATA_CACHE_CONTROL_TTL_SCALE", 1.0))


def breakpoints_pin(*, tenant, deployment, revision: str, tokens: list[int], marks: list[Mark],
                    cache_salt: str | None, block_size: int, key_prefix: str, actor: Actor
                    ) -> tuple[list[Kept], list[tuple[workers.Target, float]]]:
    """The fate of each of ``marks`` (in their order) and the pins to send to the replicas (each row
    created or extended, with its new end). New rows are audited (``cache.create``, kind ``prefix``)."""
    now = time.time()
    scale = ttl_scale()
    fates: dict[int, Kept] = {}
    to_pin: list[tuple[NamedCache, float]] = []
    with transaction.atomic():
        locked = Tenant.objects.select_for_update().only("pk", "max_pinned_tokens").get(pk=tenant.pk)
        room = int(locked.max_pinned_tokens or 0) - pinned_tokens_in_use(tenant)
        covered_until: float | None = None
        for index in sorted(range(len(marks)), key=lambda i: -marks[i].tokens):
            mark = marks[index]
            n = min(mark.tokens, len(tokens)) // block_size * block_size
            until = now + mark.ttl_seconds * scale
            if n == 0:
                fates[index] = Kept(mark.tokens, mark.ttl, "too_short")
                continue
            if covered_until is not None and covered_until >= until:
                fates[index] = Kept(mark.tokens, mark.ttl, "pinned", n, covered_until)
                continue
            prefix = list(tokens[:n])
            label = _label(revision, cache_salt, prefix)
            row = caches_live(tenant).filter(deployment=deployment, kind=KIND, display_name=label,
                                             pinned_tokens__gt=0).first()
            if row is not None:
                until = max(until, row.expires_at.timestamp())
                row.expires_at = datetime.fromtimestamp(until, UTC)
                row.save(update_fields=["expires_at", "updated"])
            elif n <= room:
                room -= n
                row = NamedCache.objects.create(
                    tenant=tenant, deployment=deployment, revision=revision, kind=KIND, token_ids=prefix,
                    cache_salt=cache_salt, display_name=label, tokens=n, pinned_tokens=n, key_prefix=key_prefix,
                    block_size=block_size, expires_at=datetime.fromtimestamp(until, UTC))
                audit_record(actor=actor, action="cache.create", target=row.public_id, tenant=tenant.slug,
                             new={"model": deployment.name, "kind": KIND, "tokens": n, "pinned_tokens": n,
                                  "ttl_seconds": int(timedelta(seconds=until - now).total_seconds()),
                                  "key_prefix": key_prefix})
            else:
                fates[index] = Kept(mark.tokens, mark.ttl, "not_pinned")
                continue
            to_pin.append((row, until))
            covered_until = until if covered_until is None else max(covered_until, until)
            fates[index] = Kept(mark.tokens, mark.ttl, "pinned", n, until)
        targets = [(workers.target(row), until) for row, until in to_pin]
    return [fates[i] for i in range(len(marks))], targets


def pin_on_replicas(targets: list[tuple[workers.Target, float]]) -> None:
    """Send the pins ``breakpoints_pin`` decided to every replica (Ray calls only: off the database
    threads)."""
    for target, until in targets:
        workers.pin_everywhere(target, until)

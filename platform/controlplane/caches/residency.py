"""Where a named cache's tokens are now: each running replica asked (``cache_resident``, a count of the
prefix's blocks per tier, no KV moved) within one short deadline, and the answer kept as the row's last
known figures.

A cache's ``tiers`` are what the replicas say now: per tier the most any replica that answered holds
(a request routed there reuses that much; L3 is shared by the replicas). When no replica answered in
time (stopped, dead, busy past ``ASK_TIMEOUT_S``) they are the last known figures, ``stale`` and
``as_of`` when they were last true. No caller waits on a replica for more than ``ASK_TIMEOUT_S`` in
all, however many caches and replicas it asks about.

``targets`` reads the database (call it on a database thread), ``ask`` only calls Ray (call it off the
database threads: a slow replica holds no thread that admissions wait for), ``remember`` writes the
answer back (database).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from controlplane.caches import workers
from controlplane.caches.models import NamedCache
from controlplane.common.errors import Unavailable
from controlplane.runtime import gateway
from workers.protocol import TIERS

logger = logging.getLogger("controlplane.caches")

ASK_TIMEOUT_S = 1.0  # the most a read of caches waits for the replicas, in all
_REMEMBER_EVERY_S = 30.0  # unchanged figures are written back at most this often (as_of kept fresh)
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="cache-residency")


@dataclass(frozen=True)
class Residency:
    """``tiers`` (tokens per tier), ``as_of`` (when they were true) and ``stale`` (no replica answered:
    the last known figures)."""

    tiers: dict
    as_of: datetime | None
    stale: bool

    def as_json(self) -> dict:
        return {"tiers": self.tiers, "tiers_as_of": int(self.as_of.timestamp()) if self.as_of else None,
                "tiers_stale": self.stale}


def targets(caches: list[NamedCache]) -> dict[int, workers.Target]:
    """Each cache's ``Target`` (database reads: its tenant's scope and keys, its model's spec)."""
    out = {}
    for cache in caches:
        try:
            out[cache.pk] = workers.target(cache)
        except Exception as exc:  # a model being deleted: its cache reads as last known
            logger.info("no residency target for %s: %r", cache.public_id, exc)
    return out


def _ask_one(where: workers.Target, index: int, deadline: float) -> dict | None:
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    try:
        res = gateway.call(where.spec, "cache_resident", where.req, create=False, replica=index, timeout=left)
    except Unavailable as exc:
        logger.info("cache_resident of %s on replica %s: %s", where.public_id, index, exc.message)
        return None
    return (res or {}).get("tiers") if isinstance(res, dict) else None


def ask(found: dict[int, workers.Target], *, timeout: float = ASK_TIMEOUT_S) -> dict[int, dict]:
    """Tokens per tier now, for each cache some replica answered about within ``timeout`` (in all):
    ``{cache pk: {"l1", "l2", "l3"}}``; a cache no replica answered about is absent. Ray calls only."""
    deadline = time.monotonic() + timeout
    jobs = {}
    for pk, where in found.items():
        for index in gateway.replica_set(where.spec).indices():
            jobs[_POOL.submit(_ask_one, where, index, deadline)] = pk
    done, _ = wait(list(jobs), timeout=max(0.0, deadline - time.monotonic()) + 0.05)
    out: dict[int, dict] = {}
    for future in done:
        tiers = future.exception() is None and future.result()
        if not tiers:
            continue
        best = out.setdefault(jobs[future], {t: 0 for t in TIERS})
        for t in TIERS:
            best[t] = max(best[t], int(tiers.get(t, 0)))
    return out


def residency(cache: NamedCache, answered: dict[int, dict]) -> Residency:
    """``cache``'s figures: the replicas' answer (fresh, as of now) or its row's last known (stale)."""
    now = answered.get(cache.pk)
    if now is not None:
        return Residency(tiers=now, as_of=timezone.now(), stale=False)
    return Residency(tiers={t: int((cache.tiers or {}).get(t, 0)) for t in TIERS},
                     as_of=cache.tiers_at or cache.created, stale=True)


def recorded(cache: NamedCache) -> Residency:
    """``cache``'s row as it stands, nobody asked: stale once older than ``_REMEMBER_EVERY_S`` (a
    prewarm's or a pin's answer just written is fresh)."""
    as_of = cache.tiers_at or cache.created
    old = as_of is None or (timezone.now() - as_of).total_seconds() >= _REMEMBER_EVERY_S
    return Residency(tiers={t: int((cache.tiers or {}).get(t, 0)) for t in TIERS}, as_of=as_of, stale=old)


def remember(caches: list[NamedCache], answered: dict[int, dict]) -> None:
    """Write the answered figures back as each row's last known (only when they changed, or to keep
    ``tiers_at`` within ``_REMEMBER_EVERY_S``): what a later read shows when no replica answers."""
    now = timezone.now()
    for cache in caches:
        tiers = answered.get(cache.pk)
        if tiers is None:
            continue
        fresh = cache.tiers_at is not None and (now - cache.tiers_at).total_seconds() < _REMEMBER_EVERY_S
        if tiers == cache.tiers and fresh:
            continue
        NamedCache.objects.filter(pk=cache.pk).update(tiers=tiers, tiers_at=now)
        cache.tiers, cache.tiers_at = tiers, now


def now_for(caches: list[NamedCache], *, timeout: float = ASK_TIMEOUT_S) -> dict[int, Residency]:
    """In one thread (sync views: the admin API, the console): ask, remember, and each cache's figures."""
    caches = list(caches)
    answered = ask(targets(caches), timeout=timeout)
    remember(caches, answered)
    return {c.pk: residency(c, answered) for c in caches}

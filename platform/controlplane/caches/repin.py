"""Pins follow replicas across restarts: a replica keeps its pins in memory, so one that started
anew (another ``boot_id`` in its stats) has none. The stats sampler hands every poll of the replicas
here (``timeseries.services.sample_take``); a replica seen with a boot id this process has not seen
gets the live pinned caches of its model pinned again. The first sight of a replica after this
process started counts as new (pinning twice is harmless: it only moves the pin's end to the same
time)."""

from __future__ import annotations

import logging
import threading

from controlplane.caches import workers as cache_workers
from controlplane.caches.models import NamedCache
from controlplane.runtime import gateway

logger = logging.getLogger("controlplane.caches")

_seen: dict[tuple[str, int], str] = {}
_lock = threading.Lock()


def _new_boots(polled: list[dict]) -> list[tuple[str, int]]:
    fresh = []
    with _lock:
        for w in polled:
            boot = (w.get("worker") or {}).get("boot_id") if w.get("status") == "ok" else None
            key = (w.get("model"), int(w.get("replica", 0)))
            if boot and _seen.get(key) != boot:
                _seen[key] = boot
                fresh.append(key)
    return fresh


def repin_restarted(polled: list[dict]) -> int:
    """Pin again, on each replica of ``polled`` (``cluster_stats()["workers"]``) that started anew,
    its model's live pinned caches. Returns how many pins were sent."""
    from django.utils import timezone

    sent = 0
    for model, replica in _new_boots(polled):
        caches = list(NamedCache.objects.filter(deployment__name=model, deleted_at__isnull=True, pinned_tokens__gt=0,
                                                expires_at__gt=timezone.now()).select_related("tenant", "deployment"))
        if not caches:
            continue
        spec = gateway.spec_for(caches[0].deployment)
        for cache in caches:
            try:
                gateway.call(spec, "cache_pin", cache_workers.cache_request(cache), cache.expires_at.timestamp(),
                             create=False, replica=replica)
                sent += 1
            except Exception as exc:  # the next poll sees the same boot id: tried again only on a new one
                logger.warning("re-pinning %s on %s/%s failed: %s", cache.public_id, model, replica, exc)
        logger.info("re-pinned %d named caches on %s replica %s", sent, model, replica)
    return sent

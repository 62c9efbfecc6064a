"""A process-local Django cache backend for limit and lockout state: it never drops a live entry.

Django's ``LocMemCache`` culls the least recently used third of its entries when it is full, so any
client that can make the server write new keys (anonymous logins with new user names, bad keys from
new addresses) can erase rate-limit windows and lockouts. :class:`ExpiringOnlyCache` is the same
store with one change: when it holds ``MAX_ENTRIES`` entries it drops only the expired ones, and if
every entry is still live a *new* key is refused with :class:`LimitStoreFull` (an existing key can
always be read, changed or deleted). Callers choose what a refusal means: the throttle treats a
source it cannot track as locked (``common.throttle``), the rate limiter answers 429.

Each refusal would otherwise scan the whole store; after a scan that freed nothing, the next one
waits until the soonest expiry among the entries (:meth:`ExpiringOnlyCache.full_for` says how long),
so a full store costs O(1) per refused write.

The embedded default (no ``REDIS_URL``) uses it for the ``limits`` and ``lockouts`` caches; with
``REDIS_URL`` both are Redis, shared by every web process (settings ``CACHES``).
"""

from __future__ import annotations

import math
import time

from django.core.cache.backends.base import DEFAULT_TIMEOUT
from django.core.cache.backends.locmem import LocMemCache


class LimitStoreFull(Exception):
    """Every entry of the store is live: a new key cannot be added until one expires."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"limit store full of live entries; room in {retry_after} s")
        self.retry_after = retry_after


# Per store name, like LocMemCache's own globals: Django builds one backend object per thread.
_soonest: dict[str, list[float]] = {}


class ExpiringOnlyCache(LocMemCache):
    """``LocMemCache`` whose eviction only drops expired entries (see the module docstring)."""

    def __init__(self, name, params):
        super().__init__(name, params)
        self._soonest = _soonest.setdefault(name, [math.inf])  # no entry expires before [0]

    @property
    def _next_expiry(self) -> float:
        return self._soonest[0]

    @_next_expiry.setter
    def _next_expiry(self, value: float) -> None:
        self._soonest[0] = value

    def _set(self, key, value, timeout=DEFAULT_TIMEOUT):
        if key not in self._cache and len(self._cache) >= self._max_entries:
            wait = self._room_in()
            if wait is not None:
                raise LimitStoreFull(wait)
        self._cache[key] = value
        self._cache.move_to_end(key, last=False)
        expires = self._expire_info[key] = self.get_backend_timeout(timeout)
        if expires is not None:
            self._next_expiry = min(self._next_expiry, expires)

    def _cull(self) -> None:  # never called by _set above; kept safe for any other caller
        self._sweep(time.time())

    def _sweep(self, now: float) -> None:
        soonest = math.inf
        for key, expires in list(self._expire_info.items()):
            if expires is not None and expires <= now:
                self._delete(key)
            elif expires is not None:
                soonest = min(soonest, expires)
        self._next_expiry = soonest

    def _room_in(self) -> int | None:
        """``None`` when a new key fits (after dropping expired entries if that is due), else the
        seconds until the soonest live entry expires. Call with the lock held."""
        if len(self._cache) < self._max_entries:
            return None
        now = time.time()
        if now >= self._next_expiry:
            self._sweep(now)
            if len(self._cache) < self._max_entries:
                return None
        if math.isinf(self._next_expiry):
            return 60
        return max(1, math.ceil(self._next_expiry - now))

    def full_for(self) -> int | None:
        """Seconds until a new key can be added, or ``None`` when one can be now."""
        with self._lock:
            return self._room_in()

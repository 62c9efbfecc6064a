"""Failure counters, lockouts and once-per-window gates in Django's caches.

Lockout state (failure counts, locks, backoffs, the per-account tally) lives in the ``lockouts``
cache, which traffic cannot evict: with ``REDIS_URL`` it is Redis, shared by every web process; the
embedded default is this process's :class:`~controlplane.common.limit_store.ExpiringOnlyCache`,
which drops only expired entries and refuses new keys while every entry is live. A refused key is
*locked*: while that store is full, :func:`throttle_retry_after` answers "locked until an entry
expires" for every key that has no lock slot of its own, so filling the store never buys anyone
untracked attempts. A key takes its lock slot (a placeholder ``0``) with its first failure, so
keys already tracked keep working normally when the store fills. The audit aggregation's tallies
and windows (``audit.aggregate``) pass ``store="default"``: losing them costs extra audit events,
never a lockout. Keys are digests of the caller's key (usernames and addresses are attacker-chosen;
they never become cache keys verbatim). Everything expires by itself.

A cache that fails (Redis down) fails open and loudly: nothing is locked, every failure opens its
window (so it is audited one by one), and a warning is logged; authentication itself keeps working.

- :func:`throttle_failure` counts a failure and locks the key once ``limit`` are reached within
  ``window_s``; :func:`throttle_retry_after` says whether (and for how long) it is locked;
  :func:`throttle_clear` forgets both (a successful login).
- :func:`throttle_backoff_failure` counts a failure and, from the ``free``-th on, locks the key for a
  delay that doubles with each further failure (capped); the count is forgotten ``memory_s`` after
  the last failure.
- :func:`throttle_window_open` is true for the first call per key in each window;
  :func:`throttle_tally_add` / :func:`throttle_tally_take` count what happened in between.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import ipaddress
import logging
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.core.cache import BaseCache, caches

from controlplane.common.limit_store import LimitStoreFull

PREFIX = "strata:th"
LOCKOUTS = "lockouts"
TALLY_TTL_S = 24 * 3600
logger = logging.getLogger("controlplane.throttle")
F = TypeVar("F", bound=Callable[..., Any])


def _fail_open(fallback: Any) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except LimitStoreFull:  # the key stays untracked, which throttle_retry_after locks
                return fallback
            except Exception:  # any cache backend error: throttling must not take authentication down
                logger.warning("throttle cache unavailable in %s; failing open", func.__name__, exc_info=True)
                return fallback

        return wrapper  # type: ignore[return-value]

    return decorate


def _key(scope: str, key: str, part: str) -> str:
    # STRATA_THROTTLE_NAMESPACE (tests: per process, per test) keeps runs sharing one Redis apart.
    namespace = getattr(settings, "STRATA_THROTTLE_NAMESPACE", "")
    return f"{PREFIX}:{namespace}:{scope}:{part}:{hashlib.sha256(key.encode('utf-8')).hexdigest()[:32]}"


def _incr(cache: BaseCache, name: str, amount: int, timeout: int) -> int:
    cache.add(name, 0, timeout=timeout)
    try:
        return cache.incr(name, amount)
    except ValueError:  # expired between add and incr
        cache.set(name, amount, timeout=timeout)
        return amount


def _full_for(cache: BaseCache) -> int | None:
    """Seconds until ``cache`` takes new keys again (only a bounded process-local store fills)."""
    full_for = getattr(cache, "full_for", None)
    return full_for() if full_for is not None else None


def source_bucket(address: str) -> str:
    """What one source is, for throttling: an IPv4 address, or the /64 of an IPv6 address (one
    host commonly holds a whole /64)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


@_fail_open(None)
def throttle_retry_after(*, scope: str, key: str) -> int | None:
    """Seconds until ``key`` may try again, or ``None`` when it is not locked (also locked: a key
    without a lock slot while the store is full, see the module docstring)."""
    cache = caches[LOCKOUTS]
    until = cache.get(_key(scope, key, "lock"))
    if until is None:
        return _full_for(cache)
    left = until - time.time()
    return max(1, math.ceil(left)) if left > 0 else None


@_fail_open(None)
def throttle_failure(*, scope: str, key: str, limit: int, window_s: int, lockout_s: int) -> int | None:
    """Count one failure of ``key``. When it is the ``limit``-th within ``window_s`` (counted from
    the first), lock ``key`` for ``lockout_s`` and return that; otherwise ``None``."""
    cache = caches[LOCKOUTS]
    count = _incr(cache, _key(scope, key, "count"), 1, window_s)
    cache.add(_key(scope, key, "lock"), 0, timeout=window_s + lockout_s)  # the lock's slot
    if count < limit:
        return None
    cache.set(_key(scope, key, "lock"), time.time() + lockout_s, timeout=lockout_s)
    cache.delete(_key(scope, key, "count"))  # a fresh count once the lock has passed
    return lockout_s


@_fail_open((1, None))
def throttle_backoff_failure(*, scope: str, key: str, free: int, base_s: int, cap_s: int,
                             memory_s: int) -> tuple[int, int | None]:
    """Count one failure of ``key``; return ``(failures, delay)``. ``delay`` is ``None`` below
    ``free`` failures, else ``min(cap_s, base_s * 2 ** (failures - free))`` and ``key`` is locked
    for it. Each failure keeps the count for another ``memory_s``."""
    cache = caches[LOCKOUTS]
    name = _key(scope, key, "count")
    count = _incr(cache, name, 1, memory_s)
    cache.touch(name, memory_s)
    cache.add(_key(scope, key, "lock"), 0, timeout=memory_s + cap_s)  # the lock's slot
    if count < free:
        return count, None
    delay = min(cap_s, base_s * 2 ** min(count - free, 32))
    cache.set(_key(scope, key, "lock"), time.time() + delay, timeout=delay)
    return count, delay


@_fail_open(None)
def throttle_clear(*, scope: str, key: str) -> None:
    """Forget ``key``'s failures and lock."""
    caches[LOCKOUTS].delete_many([_key(scope, key, "count"), _key(scope, key, "lock")])


@_fail_open(True)
def throttle_window_open(*, scope: str, key: str, window_s: int, store: str = LOCKOUTS) -> bool:
    """True for the first call per ``key`` in each ``window_s`` (atomic: ``cache.add``)."""
    return caches[store].add(_key(scope, key, "gate"), 1, timeout=window_s)


@_fail_open(1)
def throttle_tally_add(*, scope: str, key: str, amount: int = 1, ttl_s: int = TALLY_TTL_S,
                       store: str = LOCKOUTS) -> int:
    """Add ``amount`` to ``key``'s tally; returns the new total."""
    return _incr(caches[store], _key(scope, key, "tally"), amount, ttl_s)


@_fail_open(1)
def throttle_tally_take(*, scope: str, key: str, store: str = LOCKOUTS) -> int:
    """Return ``key``'s tally and subtract it (increments racing with this are kept)."""
    cache = caches[store]
    name = _key(scope, key, "tally")
    value = cache.get(name) or 0
    if value:
        with contextlib.suppress(ValueError):  # expired meanwhile
            cache.decr(name, value)
    return value

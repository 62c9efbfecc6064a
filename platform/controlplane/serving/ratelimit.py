"""Per-tenant request and token rate limits (fixed one-minute windows in the ``limits`` cache).

Only authenticated tenants write that cache, and it never evicts a live window: with ``REDIS_URL``
it is Redis, shared by every web process (several processes behind one balancer enforce one limit);
the embedded default is this process's ``common.limit_store.ExpiringOnlyCache``, which drops only
expired windows (and, were it ever full of live ones, refuses the request with 429 rather than
forget a window). A limit that is hit answers 429 with ``Retry-After`` set to the seconds left in
the window.

Requests are counted by ``count_request`` right after authentication, before the body is read or
parsed, so a request refused later (413, 422, 400) still used one of the tenant's requests: a tenant
cannot make the server parse or tokenize more bodies per minute than its ``requests_per_minute``.
A request refused by this 429 itself is not counted. Tokens are counted once they are known, by
``admit`` with ``requests_per_minute=None``.
"""

from __future__ import annotations

import time

from django.core.cache import caches

from controlplane.common.errors import RateLimited
from controlplane.common.limit_store import LimitStoreFull

WINDOW_S = 60
STORE = "limits"


def _window() -> tuple[int, int]:
    now = time.time()
    start = int(now // WINDOW_S) * WINDOW_S
    return start, max(1, int(start + WINDOW_S - now + 0.999))


def _incr(key: str, amount: int) -> int:
    cache = caches[STORE]
    try:
        cache.add(key, 0, timeout=WINDOW_S * 2)
    except LimitStoreFull as exc:
        raise RateLimited("too many rate-limit windows are open on this server; retry later",
                          retry_after=exc.retry_after, code="rate_limit_store_full") from None
    return cache.incr(key, amount)


def count_request(*, tenant_id: int, requests_per_minute: int | None) -> None:
    """Count one request for the tenant, or raise ``RateLimited`` (not counted) when its limit is used."""
    admit(tenant_id=tenant_id, requests_per_minute=requests_per_minute, tokens_per_minute=None, tokens=0)


def admit(*, tenant_id: int, requests_per_minute: int | None, tokens_per_minute: int | None, tokens: int) -> None:
    """Count one request of ``tokens`` tokens for the tenant or raise ``RateLimited`` (counting nothing)."""
    start, retry_after = _window()
    cache = caches[STORE]
    rkey, tkey = f"strata:rl:{tenant_id}:{start}:req", f"strata:rl:{tenant_id}:{start}:tok"
    if requests_per_minute is not None and _incr(rkey, 1) > requests_per_minute:
        cache.decr(rkey, 1)
        raise RateLimited(f"rate limit of {requests_per_minute} requests per minute reached",
                          retry_after=retry_after, code="rate_limit_requests")
    if tokens_per_minute is not None:
        if tokens > tokens_per_minute:
            if requests_per_minute is not None:
                cache.decr(rkey, 1)
            raise RateLimited(f"this request needs {tokens} tokens, above the limit of {tokens_per_minute} "
                              "tokens per minute", retry_after=retry_after, code="rate_limit_tokens")
        if _incr(tkey, tokens) > tokens_per_minute:
            cache.decr(tkey, tokens)
            if requests_per_minute is not None:
                cache.decr(rkey, 1)
            raise RateLimited(f"rate limit of {tokens_per_minute} tokens per minute reached",
                              retry_after=retry_after, code="rate_limit_tokens")

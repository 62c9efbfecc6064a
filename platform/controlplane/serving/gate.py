"""ASGI gate of the serving API: what a tenant may not send is refused before its body is read.

Django's ASGI handler reads a whole request body before any view runs, so a tenant past its
``requests_per_minute``, or announcing a body larger than its models can need, would still make the
web process receive and spool every byte (up to the path's limit) just to be refused. ``RequestGate``
looks at the bearer key first and answers, with ``Connection: close`` and without reading the body,

- 429 with ``Retry-After`` when the key's tenant has no request left in this minute's window;
- 413 when the declared ``Content-Length`` is over ``context.body_limit_for`` (the tenant's models
  and ``max_prompt_tokens``); a chunked body is measured by the view once read.

It counts nothing and admits nothing: anything it lets through is authenticated, counted and bounded
again by the view (``context.admit_with_limit``), and an unknown, revoked or suspended key goes on to
the view's 401/403.
"""

from __future__ import annotations

import hashlib
import math
import time

from asgiref.sync import sync_to_async

from controlplane.common.asgi_limits import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    declared_length,
    send_error,
    too_large_message,
)
from controlplane.common.errors import RateLimited
from controlplane.serving import ratelimit

SMALL_BODY = 8 * 1024  # bodies up to this skip the look-up of the tenant's limit here (the view checks them)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, raw = value.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return None
            return raw.strip() or None
    return None


def _exhausted(raw_key: str, path: str, declared: int | None) -> tuple[int, int] | int | None:
    """(requests_per_minute, Retry-After) when the key's active tenant has no request left; the body
    limit when ``declared`` is over it; else None."""
    from controlplane.serving.context import body_limit_for
    from controlplane.tenants.selectors import tenant_authenticate

    result = tenant_authenticate(raw_key)
    if result is None or not result.ok:
        return None
    rpm = result.tenant.requests_per_minute
    retry = ratelimit.requests_left(tenant_id=result.tenant.pk, requests_per_minute=rpm)
    if retry is not None:
        return rpm, retry
    if declared is not None and declared > SMALL_BODY:
        limit = body_limit_for(path, result.tenant)
        if declared > limit:
            try:  # a refused request counts like any other (``ratelimit``)
                ratelimit.count_request(tenant_id=result.tenant.pk, requests_per_minute=rpm)
            except RateLimited as exc:
                return rpm, int(exc.headers["Retry-After"])
            return limit
    return None


_aexhausted = sync_to_async(_exhausted, thread_sensitive=True)


class RequestGate:
    """ASGI middleware for ``/v1/``: POSTs of a tenant past its request rate get 429 unread, and those
    announcing a body over the tenant's limit 413 (counted as a request).

    A 429 is remembered in this process, by the key's SHA-256, until its window ends, so the
    repeats of a client that keeps sending are refused without a database lookup or a thread hop
    (at most ``MAX_REMEMBERED`` keys). Remembering only ever refuses, until the window it was
    computed for ends; a key revoked meanwhile is 429 rather than 401 until then, and a raised
    ``requests_per_minute`` applies from the next window."""

    MAX_REMEMBERED = 10_000

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._refused: dict[bytes, tuple[float, int]] = {}  # key digest -> (window end, requests per minute)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            raw = _bearer(scope)
            refused = await self._refusal(raw, scope) if raw else None
            if isinstance(refused, int):
                return await send_error(send, 413, too_large_message(refused), close=True)
            if refused is not None:
                rpm, retry = refused
                return await send_error(send, 429, f"rate limit of {rpm} requests per minute reached", close=True,
                                        code="rate_limit_requests", headers={"Retry-After": str(retry)})
        return await self.app(scope, receive, send)

    async def _refusal(self, raw: str, scope: Scope) -> tuple[int, int] | int | None:
        digest, now = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).digest(), time.time()
        known = self._refused.get(digest)
        if known is not None and now < known[0]:
            return known[1], max(1, math.ceil(known[0] - now))
        try:
            declared = declared_length(scope.get("headers", ()))
        except ValueError:
            declared = None  # BodyLimit, in front of this gate, answered it already
        refused = await _aexhausted(raw, scope.get("path", ""), declared)
        if isinstance(refused, tuple):
            if len(self._refused) >= self.MAX_REMEMBERED:
                self._refused = {k: v for k, v in self._refused.items() if v[0] > now}
            if len(self._refused) < self.MAX_REMEMBERED:
                self._refused[digest] = (now + refused[1], refused[0])
        return refused

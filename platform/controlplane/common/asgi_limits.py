"""Request-body limits enforced at the ASGI layer, before Django reads (and spools) any body.

Django's ``ASGIHandler`` reads the whole body into a temporary file before the first middleware
runs, so a limit checked in middleware or a view comes too late: the bytes are already on disk or in
memory. :class:`BodyLimit` wraps an ASGI app and

- answers 413 at once, without reading the body, when the declared ``Content-Length`` is over the
  limit (400 when the header is not a number);
- otherwise (chunked or undeclared bodies, or a body longer than declared) counts the bytes the app
  receives and answers 413 as soon as the count passes the limit; the app is told the client
  disconnected, and the response carries ``Connection: close`` so the server stops reading the
  rest instead of buffering it.

Errors use the one JSON shape of every Strata API (``{"error": {"message", "type", "code"}}``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from django.conf import settings

from controlplane.common.errors import error_body

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


KV_STORE_PATH = "/v1/kv/store"


def body_limit(path: str) -> int:
    """Largest request body accepted on ``path``: ``STRATA_ADMIN_MAX_BODY_BYTES`` on the admin API,
    ``STRATA_SERVING_MAX_BODY_BYTES`` (a few MiB) on the serving API, whose JSON bodies hold prompts
    bounded by a context length, except KV uploads (``/v1/kv/store``: base64 KV bytes), which keep
    ``STRATA_MAX_BODY_BYTES`` like the UI and Django's admin (the view then applies the tighter limit
    derived from the tenant's models, ``serving.bounds.kv_store_body_limit``). Read per request so a
    changed setting applies at once."""
    if path.startswith("/api/admin/"):
        return settings.STRATA_ADMIN_MAX_BODY_BYTES
    if path.startswith("/v1/") and path.rstrip("/") != KV_STORE_PATH:
        return settings.STRATA_SERVING_MAX_BODY_BYTES
    return settings.STRATA_MAX_BODY_BYTES


def declared_length(headers) -> int | None:
    """The ``Content-Length`` of ASGI ``headers``; None when absent. ``ValueError`` when it is not
    one non-negative integer (repeated headers must agree)."""
    values = {value.strip() for name, value in headers if name.lower() == b"content-length"}
    if not values:
        return None
    if len(values) > 1:
        raise ValueError("conflicting Content-Length headers")
    raw = values.pop()
    if not raw.isdigit():
        raise ValueError("Content-Length is not a non-negative integer")
    return int(raw)


async def send_error(send: Send, status: int, message: str, *, close: bool = False, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    """Send a whole JSON error response on ``send`` (``code`` and extra ``headers``, e.g. Retry-After)."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-content-type-options", b"nosniff"),
        *((name.lower().encode(), value.encode()) for name, value in (headers or {}).items()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def too_large_message(limit: int) -> str:
    return f"request body too large (limit {limit} bytes)"


class BodyLimit:
    """ASGI middleware: refuse HTTP request bodies over ``limit_for(path)`` bytes (see module doc)."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int] = body_limit) -> None:
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope.get("path", ""))
        try:
            declared = declared_length(scope.get("headers", ()))
        except ValueError as exc:
            return await send_error(send, 400, f"invalid Content-Length header: {exc}", close=True)
        if declared is not None and declared > limit:
            return await send_error(send, 413, too_large_message(limit), close=True)

        received = 0
        started = False  # the app began its response (too late for ours)
        cut = False  # the body passed the limit: the app reads nothing more of it
        refused = False  # we answered 413; the app's own response is dropped

        async def limited_receive() -> Message:
            nonlocal received, cut, refused
            if cut:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    cut = True
                    if not started:
                        refused = True
                        await send_error(send, 413, too_large_message(limit), close=True)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

"""ASGI gate of the serving API: a request is admitted, or refused, before its body is read.

Django's ASGI handler reads a whole request body before any view runs, so a tenant past its
``requests_per_minute``, or announcing a body larger than its models can need, would still make the
web process receive and spool every byte (up to the path's limit) just to be refused. For a POST to
one of the serving API's endpoints with a bearer key, ``RequestGate`` makes the request's
``admission.Admission`` first (the key authenticated and marked used, the request counted, the tenant's
grants and body limit read: one read of the access generation for a key used before, else one key
lookup and one grant query) and answers, with
``Connection: close`` and without reading the body (the same for every call of the named caches,
``/v1/caches`` and ``/v1/caches/{id}``, whatever its method: ``admits``),

- 401 / 403 / 429 as the view would (unknown, revoked or suspended key; bad keys from a throttled
  source, ``keyguard``; a tenant with no request left in this minute's window, with ``Retry-After``);
- 413 when the declared ``Content-Length`` is over the admission's body limit (``admission.body_limit_for``:
  the tenant's models and ``max_prompt_tokens``); a chunked body is measured by the view once read;
- 503 with ``Retry-After`` when the database or cache fails during admission (never a bare 500).

What it lets through carries its ``Admission`` in the ASGI scope's ``state`` (only the server writes a
scope), so the view neither looks the key up nor counts the request again.

A small body (``Content-Length`` at most ``SMALL_BODY``, no ``Expect: 100-continue``) to an endpoint
prepared in one job (``DEFERRED_PATHS``: completions and the KV API, not chats, which the render pool
parses first) that arrives within ``BODY_WAIT_S`` of the headers, as a client sends it, is read
first: the gate then leaves an ``admission.Deferred`` in the scope, and the view's preparation job on a
database thread admits the request before it parses anything (``admission.admitted``): one hop to the
database threads instead of two, with every check of the admission, in the same order, and the same
JSON errors (without ``Connection: close``: the body was read). A body that has not come within
``BODY_WAIT_S`` is admitted first as above, so a client that announces a body and holds it back is
still refused unread. The gate's database work
runs on the serving database threads (``db_threads``: connections kept between requests), and a warm
key costs one read there (``admission``: ``access_cache``); Django's own per-request steps then run
on a long-lived lane thread (``lanes``) rather than a thread started for the request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time

from controlplane.common.asgi_limits import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    body_limit,
    declared_length,
    send_error,
    too_large_message,
)
from controlplane.common.errors import ApplicationError, TooLarge
from controlplane.common.sources import request_source
from controlplane.serving import admission, context, db_threads, health, lanes

SMALL_BODY = context.INLINE_BODY  # completion bodies up to this are handled whole in one step by the view
log = logging.getLogger(__name__)
ADMITTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/kv/lookup", "/v1/kv/store",
                            "/v1/kv/retrieve", "/v1/responses"})
DEFERRED_PATHS = ADMITTED_PATHS - {"/v1/chat/completions", "/v1/responses"}  # prepared whole in one database-thread job
BODY_WAIT_S = 0.05  # how long a small body may take after its headers to be read before admission
CACHES_METHODS = frozenset({"GET", "POST"})  # /v1/caches
CACHE_METHODS = frozenset({"GET", "PATCH", "DELETE"})  # /v1/caches/{id}
# /v1/messages: Anthropic's Messages API, its key as a bearer or x-api-key; rendered like a chat (never deferred)
ADMITTED_PATHS = ADMITTED_PATHS | admission.API_KEY_PATHS


def admits(method: str, path: str) -> bool:
    """Is ``method`` on ``path`` a tenant call the gate admits: a POST to a completion or KV endpoint,
    or a call the named caches' views serve (``/v1/caches``, ``/v1/caches/{id}``)?"""
    if path in ADMITTED_PATHS:
        return method == "POST"
    if path == admission.CACHES_PATH:
        return method in CACHES_METHODS
    cache_id = path.removeprefix(admission.CACHES_PATH + "/")
    return cache_id != path and bool(cache_id) and "/" not in cache_id and method in CACHE_METHODS


class _Prefetch:
    """A request body read by the gate before the app, handed to the app as it came (``receive``)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._messages: list[Message] = []
        self._pending: asyncio.Future | None = None  # a receive still waiting, handed on to the app

    async def read(self, limit: int, wait_s: float) -> bool:
        """Read the body; True once it is whole within ``wait_s`` and at most ``limit`` bytes (else
        what came is kept for the app, and a receive still waiting too)."""
        loop = asyncio.get_running_loop()
        deadline, size = loop.time() + wait_s, 0
        while True:
            pending = self._pending = self._pending or asyncio.ensure_future(self._receive())
            if not pending.done():
                await asyncio.wait((pending,), timeout=max(0.0, deadline - loop.time()))
                if not pending.done():
                    return False
            self._pending = None
            message = pending.result()
            self._messages.append(message)
            if message["type"] != "http.request":
                return False  # the client went away: the app sees it
            size += len(message.get("body", b""))
            if size > limit:
                return False
            if not message.get("more_body", False):
                return True

    async def receive(self) -> Message:
        if self._messages:
            return self._messages.pop(0)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return await pending
        return await self._receive()


class _ScopeRequest:
    """What ``common.sources.request_source`` reads of a request (``META``: the peer and
    ``X-Forwarded-For``), built from the ASGI scope as Django's ``ASGIRequest`` builds it."""

    def __init__(self, scope: Scope) -> None:
        client = scope.get("client")
        self.META = {"REMOTE_ADDR": client[0] if client else ""}
        forwarded = [value.decode("latin-1") for name, value in scope.get("headers", ())
                     if name.lower() == b"x-forwarded-for"]
        if forwarded:
            self.META["HTTP_X_FORWARDED_FOR"] = ",".join(forwarded)


def _authorization(scope: Scope) -> str | None:
    """The ``Authorization`` header of a request with a bearer key, or on ``admission.API_KEY_PATHS``
    its ``x-api-key`` as one (else None: the view answers it)."""
    found = {}
    for name, value in scope.get("headers", ()):
        if name.lower() in (b"authorization", b"x-api-key"):
            found.setdefault(name.lower(), value.decode("latin-1"))
    header = admission.key_header(found.get(b"authorization", ""), found.get(b"x-api-key", ""), scope.get("path", ""))
    scheme, _, raw = header.partition(" ")
    return header if scheme.lower() == "bearer" and raw.strip() else None


def _expects_continue(scope: Scope) -> bool:
    return any(name.lower() == b"expect" for name, _ in scope.get("headers", ()))


async def _prefetch(scope: Scope, receive: Receive, declared: int | None) -> tuple[bool, Receive]:
    """Whether the gate read the request's small body whole (``BODY_WAIT_S``), and the receive the app
    is to use from now on (the body as it came, then the client's)."""
    if declared is None or declared > SMALL_BODY or scope["path"] not in DEFERRED_PATHS or _expects_continue(scope):
        return False, receive
    prefetch = _Prefetch(receive)
    return await prefetch.read(SMALL_BODY, BODY_WAIT_S), prefetch.receive


def _admit(header: str, scope: Scope, declared: int | None) -> admission.Admission:
    """The request's ``Admission``; 413 when ``declared`` is over its body limit (counted, like any
    refused request)."""
    admitted = admission.admit(header, where=request_source(_ScopeRequest(scope)), method=scope["method"],
                               path=scope["path"])
    if declared is not None and declared > admitted.body_limit:
        # over the path's own limit too: named as ``BodyLimit`` names it
        path_limit = body_limit(scope["path"])
        raise TooLarge(too_large_message(path_limit if declared > path_limit else admitted.body_limit))
    return admitted


async def _aadmit(header: str, scope: Scope, declared: int | None) -> admission.Admission:
    """``_admit`` on a serving database thread."""
    return await db_threads.run(_admit, header, scope, declared)


class RequestGate:
    """ASGI middleware for ``/v1/``: the tenant calls of ``admits`` (POSTs to the serving endpoints,
    every call of the named caches) are admitted (``admission.admit``) before their bodies are read;
    what is refused is answered unread, what is admitted reaches the view with its ``Admission``.

    A 429 for a tenant out of requests is remembered in this process, by the key's SHA-256, for at most
    ``REMEMBER_S`` (and never past its window), so the repeats of a client that keeps sending are
    refused without a database lookup or a thread hop (at most ``MAX_REMEMBERED`` keys). Remembering
    only ever refuses; a key revoked or a tenant suspended meanwhile is 429 rather than 401/403 for at
    most ``REMEMBER_S``, and a raised ``requests_per_minute`` applies within that time too."""

    MAX_REMEMBERED = 10_000
    REMEMBER_S = 1.0

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        # key digest -> (remembered until, window end, message)
        self._refused: dict[bytes, tuple[float, float, str]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        header = None
        if scope["type"] == "http" and admits(scope.get("method", ""), scope.get("path", "")):
            header = _authorization(scope)
        if header is None:
            return await self.app(scope, receive, send)
        digest, now = hashlib.sha256(header.encode("utf-8", "surrogatepass")).digest(), time.time()
        known = self._refused.get(digest)
        if known is not None and now < known[0]:
            return await send_error(send, 429, known[2], close=True, code="rate_limit_requests",
                                    headers={"Retry-After": str(max(1, math.ceil(known[1] - now)))})
        try:
            declared = declared_length(scope.get("headers", ()))
        except ValueError:
            declared = None  # not a length: ``BodyLimit`` answers it (400)
        note = health.note_of(scope)
        read, receive = await _prefetch(scope, receive, declared)
        if read:  # the view's preparation job admits it (one hop to the database threads for both)
            deferred = admission.Deferred(note=note, on_refused=lambda exc: self._remember(digest, now, exc))
            async with lanes.context():  # Django's per-request steps on a long-lived thread
                await self.app({**scope, "state": {**scope.get("state", {}), admission.ADMISSION_STATE: deferred}},
                               receive, send)
            return None
        try:
            admitted = await _aadmit(header, scope, declared)
        except ApplicationError as exc:
            if note is not None:
                note.tenant = getattr(exc, "tenant_slug", "")  # a quota refusal knows whose
            if exc.code == "rate_limit_requests":
                self._remember(digest, now, exc)
            return await send_error(send, exc.status, exc.message, close=True, code=exc.code,
                                    headers=exc.headers)
        except Exception:  # the database or cache is down: a retryable JSON error, never a bare 500
            log.exception("serving admission failed")
            return await send_error(send, 503, "the service is temporarily unavailable; retry shortly",
                                    close=True, code="service_unavailable", headers={"Retry-After": "5"})
        if note is not None:
            note.tenant = admitted.tenant.slug
        state = {**scope.get("state", {}), admission.ADMISSION_STATE: admitted}
        async with lanes.context():  # Django's per-request steps on a long-lived thread
            return await self.app({**scope, "state": state}, receive, send)

    def _remember(self, digest: bytes, now: float, exc: ApplicationError) -> None:
        retry = int(exc.headers.get("Retry-After", "1"))
        if len(self._refused) >= self.MAX_REMEMBERED:
            self._refused = {k: v for k, v in self._refused.items() if v[0] > now}
        if len(self._refused) < self.MAX_REMEMBERED:
            self._refused[digest] = (now + min(retry, self.REMEMBER_S), now + retry, exc.message)

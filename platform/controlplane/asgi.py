"""ASGI entry (``uvicorn controlplane.asgi:application``, with ``platform/`` importable: editable
install or ``--app-dir platform``).

Two Django handlers share one process: the serving API (``/v1/``) runs through a lean handler whose
middleware is only ``SERVING_MIDDLEWARE`` (JSON errors and body limits), because sessions, CSRF,
messages and the other browser-oriented middleware do nothing for bearer-key JSON requests and,
under ASGI, each costs thread hops on every request (see ``bench.api_overhead``). Everything else
(admin API, UI, Django admin, health) runs through the standard handler and ``settings.MIDDLEWARE``.

Both sit behind :class:`~controlplane.common.asgi_limits.BodyLimit`: Django reads a whole request body
into a temporary file before any middleware runs, so bodies over the limit are refused (413) at the
ASGI layer, from ``Content-Length`` or as a chunked body passes the limit, before anything is buffered.
The serving API's :class:`~controlplane.serving.gate.RequestGate` also answers 429, unread, to a
tenant that has used this minute's requests.

Django's per-request signals of a request the gate let through (``request_started`` before the view,
``request_finished`` in ``response.close`` after the answer) run on the event loop, without a thread
hop, when their receivers are Django's own (``LOOP_SAFE_RECEIVERS``): on the loop they find no
database connection to close (the loop thread never holds one; the request's database work runs on
the serving database threads, ``serving.db_threads``, which keep theirs), and the rest only resets
per-thread state. Any other receiver sends them the Django way, through a thread (``serving.lanes``).
Those two hops were most of what Django added to a request (``bench.api_overhead``).

The process hands the GIL on every ``GIL_SWITCH_INTERVAL_S`` (Python's default is 5 ms): the event
loop shares it with the serving database threads, the accountant and Ray's callbacks, and a loop that
a request's answer has just woken otherwise waits up to the whole interval for a thread in the middle
of Python work (an ORM batch, a preparation job) to let go. ``bench.api_overhead`` (httpx client), back
to back under the same load: HTTP overhead at p50 +5.72 -> +4.93 ms and +4.22 -> +3.67 ms,
8-client throughput 0.50x -> 0.59x and 0.51x -> 0.53x of the direct calls.
"""

import asyncio
import contextlib
import os
import sys

import django
from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
django.setup(set_prefix=False)

from django.conf import settings  # noqa: E402
from django.core import signals  # noqa: E402
from django.core.cache import close_caches  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIRequest, get_script_prefix  # noqa: E402
from django.core.handlers.base import reset_urlconf  # noqa: E402
from django.db import close_old_connections, reset_queries  # noqa: E402
from django.http import HttpResponseBase  # noqa: E402
from django.urls import set_script_prefix  # noqa: E402

from controlplane.common.access_log import AccessLog  # noqa: E402
from controlplane.common.asgi_limits import BodyLimit  # noqa: E402
from controlplane.serving import admission  # noqa: E402
from controlplane.serving.anthropic.asgi import AnthropicErrors  # noqa: E402
from controlplane.serving.gate import RequestGate  # noqa: E402
from controlplane.serving.health import ServingMetrics  # noqa: E402

GIL_SWITCH_INTERVAL_S = 0.0005
sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

SERVING_PREFIX = "/v1/"
SERVING_MIDDLEWARE = ["controlplane.common.middleware.ApiErrorMiddleware"]


# Django's own receivers of request_started / request_finished: on the event loop thread they close no
# connection (it has none), clear its query log, leave its caches (close() of Django's cache backends
# does not block) and reset its urlconf. Any other receiver makes the signal go through a thread.
LOOP_SAFE_RECEIVERS = frozenset({reset_queries, close_old_connections, close_caches, reset_urlconf})
# the source of django.core.handlers.asgi.ASGIHandler.handle that ServingASGIHandler.handle follows
DJANGO_HANDLE_SOURCE_SHA256 = "98faeb5bef800331e6a8002fbc96b30e4122a23438ae45a047190a531ea11323"


def _gated(scope) -> bool:
    """Did ``serving.gate`` let this request through (its ``Admission`` or ``Deferred`` in the scope)?"""
    found = (scope.get("state") or {}).get(admission.ADMISSION_STATE)
    return isinstance(found, (admission.Admission, admission.Deferred))


def _inline(signal, sender) -> bool:
    """May ``signal`` be sent on the event loop: all its receivers for ``sender`` are ``LOOP_SAFE_RECEIVERS``."""
    sync_receivers, async_receivers = signal._live_receivers(sender)
    return not async_receivers and all(r in LOOP_SAFE_RECEIVERS for r in sync_receivers)


async def _send(signal, sender, gated: bool, **named) -> None:
    """``signal.asend``, on the loop for a gated request whose receivers allow it (``_inline``)."""
    if gated and _inline(signal, sender):
        signal.send(sender=sender, **named)
    else:
        await signal.asend(sender=sender, **named)


async def _close(response: HttpResponseBase, gated: bool) -> None:
    """``response.close()`` (its resource closers, then ``request_finished``), on the loop for a gated
    request whose ``request_finished`` receivers allow it. The closers of the serving views' responses
    never block (a fire-and-forget cancel on the worker, ``views._stream``)."""
    if gated and _inline(signals.request_finished, response._handler_class):
        response.close()
    else:
        await sync_to_async(response.close)()


class ServingASGIHandler(ASGIHandler):
    """The standard handler with the serving API's middleware chain instead of ``MIDDLEWARE``, and
    for the requests the gate let through, Django's per-request signals on the event loop (``_send``,
    ``_close``)."""

    def load_middleware(self, is_async: bool = False) -> None:
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = SERVING_MIDDLEWARE  # read once here, at start-up, before any request
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full

    async def handle(self, scope, receive, send):
        """Django 5.2's ``ASGIHandler.handle`` (``DJANGO_HANDLE_SOURCE_SHA256``: a test notices when
        Django's changes), with its two per-request signal steps through ``_send`` and ``_close``."""
        gated = _gated(scope)
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        await _send(signals.request_started, self.__class__, gated, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            await _close(error_response, gated)
            return

        async def process_request(request: ASGIRequest, send):
            response = await self.run_get_response(request)
            with contextlib.suppress(asyncio.CancelledError):  # the client disconnected during send_response
                await self.send_response(response, send)
            return response

        # the disconnect listener first: it raises nothing unexpected that would keep the view's task
        # from being cancelled
        tasks = [asyncio.create_task(self.listen_for_disconnect(receive)),
                 asyncio.create_task(process_request(request, send))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()  # views may handle their cancellation
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            await _send(signals.request_finished, self.__class__, gated)
        else:
            await _close(response, gated)
        body_file.close()


_site = BodyLimit(ASGIHandler())
# The gate first: a body declared over the path's limit from a known key counts against its tenant's
# requests per minute too (413, then 429), before BodyLimit would refuse it uncounted.
_serving = ServingMetrics(RequestGate(BodyLimit(ServingASGIHandler())))  # every /v1/ answer counted and timed
_serving = AnthropicErrors(_serving)  # /v1/messages: the errors of the layers above in Anthropic's shape


async def _route(scope, receive, send):
    if scope["type"] == "http" and scope.get("path", "").startswith(SERVING_PREFIX):
        return await _serving(scope, receive, send)
    return await _site(scope, receive, send)


# Outermost: every response carries X-Request-Id and is one JSON line of the access log.
application = AccessLog(_route)


# The platform starts: every deployment's replicas start now, in the background (runtime.warm; where
# STRATA_WARM_REPLICAS allows it: by default wherever a Ray cluster is configured), not on their first
# request. Every web process does this; each replica, a named Ray actor, still starts once.
from controlplane.runtime import warm  # noqa: E402

warm.start_at_startup()
# Weight digests a web process died computing are taken over (controlplane.hashing), from every web
# process, once their lease is stale.
from controlplane.hashing import services as hashing  # noqa: E402

hashing.start_at_startup()

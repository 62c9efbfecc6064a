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
"""

import os

import django
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
django.setup(set_prefix=False)

from django.conf import settings  # noqa: E402

from controlplane.common.asgi_limits import BodyLimit  # noqa: E402
from controlplane.serving.gate import RequestGate  # noqa: E402
from controlplane.serving.health import ServingMetrics  # noqa: E402

SERVING_PREFIX = "/v1/"
SERVING_MIDDLEWARE = ["controlplane.common.middleware.ApiErrorMiddleware"]


class ServingASGIHandler(ASGIHandler):
    """The standard handler with the serving API's middleware chain instead of ``MIDDLEWARE``."""

    def load_middleware(self, is_async: bool = False) -> None:
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = SERVING_MIDDLEWARE  # read once here, at start-up, before any request
        try:
            super().load_middleware(is_async=is_async)
        finally:
            settings.MIDDLEWARE = full


_site = BodyLimit(ASGIHandler())
# The gate first: a body declared over the path's limit from a known key counts against its tenant's
# requests per minute too (413, then 429), before BodyLimit would refuse it uncounted.
_serving = ServingMetrics(RequestGate(BodyLimit(ServingASGIHandler())))  # every /v1/ answer counted and timed


async def application(scope, receive, send):
    if scope["type"] == "http" and scope.get("path", "").startswith(SERVING_PREFIX):
        return await _serving(scope, receive, send)
    return await _site(scope, receive, send)

"""The access log and the request id, at the outermost ASGI layer (``controlplane.asgi``).

Every HTTP request gets an id (``common.request_ids``): the application sees it as the request's
only ``X-Request-Id`` header, the response carries it, and one line is logged when the response is
over, on the logger ``strata.access`` at INFO: a JSON object with ``request_id``, ``method``,
``path`` (no query string: it may carry values an operator did not mean to log), ``status`` (0: the
client went away before a response started), ``duration_ms`` (arrival to the last byte), ``tenant``
and ``model`` (the serving API's, filled in by ``serving.health.ServingMetrics`` through the
:class:`AccessNote` in the scope's state; empty elsewhere) and ``source`` (the TCP peer). One line
per request and nothing else on that logger; the web server's own access log is off
(``workers.webserver``), and ``settings.LOGGING`` writes these lines bare, one JSON object a line.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from controlplane.common.request_ids import HEADER, request_id_for

logger = logging.getLogger("strata.access")
ACCESS = "strata.access"  # the scope-state key of a request's ``AccessNote``
PATH_MAX = 512
_HEADER = HEADER.encode()


@dataclass
class AccessNote:
    """What inner layers learn about a request for its access-log line."""

    request_id: str
    tenant: str = ""
    model: str = ""


def access_note_of(scope: dict) -> AccessNote | None:
    found = (scope.get("state") or {}).get(ACCESS)
    return found if isinstance(found, AccessNote) else None


def _presented(headers) -> str | None:
    for name, value in headers:
        if name.lower() == _HEADER:
            try:
                return value.decode("ascii")
            except UnicodeDecodeError:
                return ""
    return None


class AccessLog:
    """ASGI middleware: the request id in, on the response and in one JSON log line per request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        peer = (scope.get("client") or ("", 0))[0] or ""
        headers = list(scope.get("headers") or [])
        rid = request_id_for(peer=peer, presented=_presented(headers))
        note = AccessNote(request_id=rid)
        headers = [(k, v) for k, v in headers if k.lower() != _HEADER] + [(_HEADER, rid.encode())]
        scope = {**scope, "headers": headers, "state": {**(scope.get("state") or {}), ACCESS: note}}
        seen = {"status": 0}

        async def tagged(message):
            if message["type"] == "http.response.start":
                seen["status"] = int(message.get("status", 0))
                out = [(k, v) for k, v in message.get("headers") or [] if k.lower() != _HEADER]
                message = {**message, "headers": [*out, (_HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:
            logger.info(json.dumps({
                "request_id": rid, "method": scope.get("method", ""), "path": scope.get("path", "")[:PATH_MAX],
                "status": seen["status"], "duration_ms": round((time.perf_counter() - start) * 1000, 3),
                "tenant": note.tenant, "model": note.model, "source": peer,
            }, separators=(",", ":")))

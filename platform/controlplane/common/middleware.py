"""JSON errors outside ninja for the API prefixes (``/api/``, ``/v1/``).

Ninja answers errors inside its own views; this middleware covers what never reaches them:
unresolved paths (404), wrong methods, disallowed hosts, bodies over the size limit (413 from
``Content-Length``; under ASGI ``asgi_limits.BodyLimit`` has already refused those, and chunked ones,
before Django read the body; this check covers other entry points such as the test client) and
unexpected exceptions (500 without a trace, even with ``DEBUG``). Other paths are left to Django's
normal handling, except one: a view that fails because the database is unreachable or dropped the
connection (``errors.DATABASE_DOWN``) answers 503 with Retry-After on every path (JSON under the API
prefixes, a short text page in the console), never a 500.
"""

from __future__ import annotations

import logging

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from controlplane.common.asgi_limits import body_limit, too_large_message
from controlplane.common.errors import (
    DATABASE_DOWN,
    DATABASE_RETRY_AFTER_S,
    database_unavailable_response,
    error_response,
)

logger = logging.getLogger("controlplane.errors")


def _is_api(path: str) -> bool:
    return path.startswith(tuple(settings.STRATA_JSON_ERROR_PREFIXES))


def _precheck(request: HttpRequest) -> HttpResponseBase | None:
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return error_response(400, "invalid Content-Length header")
    limit = body_limit(request.path)
    if length > limit:
        return error_response(413, too_large_message(limit))
    return None


def _database_unavailable_page() -> HttpResponse:
    page = HttpResponse("The database is unavailable for a moment; reload this page shortly.\n", status=503,
                        content_type="text/plain; charset=utf-8")
    page["Retry-After"] = str(DATABASE_RETRY_AFTER_S)
    return page


def _jsonify(request: HttpRequest, response: HttpResponseBase) -> HttpResponseBase:
    # The serving API skips SecurityMiddleware (see asgi.py); keep its one header that matters for JSON.
    response.setdefault("X-Content-Type-Options", "nosniff")
    if response.status_code < 400 or response.get("Content-Type", "").startswith("application/json"):
        return response
    status = response.status_code
    message = {404: "not found", 405: f"method {request.method} not allowed"}.get(status, "request failed")
    replacement = error_response(status, message)
    for header in ("Allow", "Retry-After", "WWW-Authenticate"):
        if header in response:
            replacement[header] = response[header]
    return replacement


class ApiErrorMiddleware:
    """Outermost middleware; sync and async capable so streaming views stay async."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self.is_async:
            return self.__acall__(request)
        if not _is_api(request.path):
            return self.get_response(request)
        early = _precheck(request)
        if early is not None:
            return early
        return _jsonify(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest):
        if not _is_api(request.path):
            return await self.get_response(request)
        early = _precheck(request)
        if early is not None:
            return early
        return _jsonify(request, await self.get_response(request))

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponseBase | None:
        if isinstance(exc, DATABASE_DOWN):  # every path: a retry may succeed, so never a 500
            logger.warning("database unavailable on %s %s: %s", request.method, request.path, exc)
            return database_unavailable_response() if _is_api(request.path) else _database_unavailable_page()
        if not _is_api(request.path):
            return None
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error")

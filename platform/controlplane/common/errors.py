"""The one error shape of every Strata HTTP API: ``{"error": {"message", "type", "code"}}``.

- :func:`error_response` builds it (the serving API uses it too);
- :class:`ApplicationError` and subclasses are what services raise; each carries its HTTP status;
- :data:`WORKER_ERRORS` and :class:`WorkerError`: the errors a cache worker answers with, by code;
- :func:`install_ninja_handlers` maps those, ninja's and Django's exceptions onto it for a NinjaAPI.

Messages are written for clients and never include stack traces, SQL or secrets.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, InterfaceError, OperationalError
from django.http import Http404, HttpRequest, JsonResponse

logger = logging.getLogger("controlplane.errors")

STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}
STATUS_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    422: "validation_error",
    429: "rate_limited",
    500: "internal_error",
    501: "not_implemented",
    503: "unavailable",
}


def error_body(status: int, message: str, type: str | None = None, code: str | None = None) -> dict:
    """The JSON body for an error; ``type``/``code`` default from the status."""
    return {
        "error": {
            "message": message,
            "type": type or STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "code": code or STATUS_CODES.get(status, f"http_{status}"),
        }
    }


def error_response(
    status: int,
    message: str,
    type: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JsonResponse:
    """A ``JsonResponse`` with the error body, ``status`` and extra ``headers`` (e.g. Retry-After)."""
    response = JsonResponse(error_body(status, message, type, code), status=status)
    for key, value in (headers or {}).items():
        response[key] = value
    return response


# The database is unreachable or dropped this process's connection (restarted, ``pg_terminate_backend``,
# network): the request may succeed on a retry, so 503 with Retry-After, never a 500.
DATABASE_DOWN = (OperationalError, InterfaceError)
DATABASE_RETRY_AFTER_S = 2


def database_unavailable_response() -> JsonResponse:
    """The JSON answer to a request whose database work failed because the database is unreachable."""
    return error_response(503, "the database is unavailable; retry shortly", code="database_unavailable",
                          headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)})


class ApplicationError(Exception):
    """Base of the errors services raise on purpose; the API layer turns them into responses."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        self.headers = dict(headers or {})

    def response(self) -> JsonResponse:
        return error_response(self.status, self.message, None, self.code, self.headers)


class InvalidInput(ApplicationError):
    """Well-formed request whose values are unacceptable (unknown preset, bad quota...)."""

    status = 422
    code = "invalid_input"


class Unauthenticated(ApplicationError):
    status = 401
    code = "unauthenticated"


class Forbidden(ApplicationError):
    status = 403
    code = "forbidden"


class NotFound(ApplicationError):
    status = 404
    code = "not_found"


class Conflict(ApplicationError):
    """The change clashes with current state (duplicate name, offboarded tenant...)."""

    status = 409
    code = "conflict"


class TooLarge(ApplicationError):
    status = 413
    code = "request_too_large"


class RateLimited(ApplicationError):
    status = 429
    code = "rate_limited"

    def __init__(self, message: str, *, retry_after: int, code: str | None = None):
        super().__init__(message, code=code, headers={"Retry-After": str(max(1, int(retry_after)))})


class Unavailable(ApplicationError):
    status = 503
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None):
        super().__init__(message, code=code, headers={"Retry-After": str(max(1, int(retry_after)))})


# Error codes a cache worker answers with (cachecore's ``CacheError.code`` and the gateway's own)
# -> (HTTP status, Retry-After seconds or None). A bad request is 4xx; a worker that is alive but
# momentarily cannot serve it is 503 with Retry-After.
WORKER_ERRORS = {
    "kv_api_unsupported": (501, None),  # a deployment on vLLM (the KV API is the strata engine's)
    "invalid_prompt": (400, None),
    "context_length_exceeded": (400, None),
    "invalid_request": (422, None),
    "invalid_kv": (422, None),
    "invalid_namespace": (422, None),
    "revision_changed": (503, 1),
    "out_of_blocks": (503, 1),
    # A tenant over its own bounds is throttled (429), never given the pool's state.
    "inflight_limit": (429, 1),
    "tenant_busy": (429, 1),
    "cancelled": (499, None),  # the client went away; nobody reads this answer
    "request_stopped": (503, 1),  # the platform stopped it (suspension, offboarding, key shred): retry
    "worker_failed": (503, 2),
}


class WorkerError(ApplicationError):
    """An error the cache worker answered with; status and Retry-After from :data:`WORKER_ERRORS`
    by ``code`` (``default`` for codes not listed)."""

    def __init__(self, message: str, *, code: str, default: tuple[int, int | None] = (422, None)):
        status, retry = WORKER_ERRORS.get(code, default)
        self.status = status
        super().__init__(message, code=code, headers={"Retry-After": str(retry)} if retry else None)

    @classmethod
    def from_event(cls, event: dict) -> WorkerError:
        """An ``error`` event of a worker's stream: a code the table does not list is the worker's
        failure, so 503 and retryable (a call's refusal, by contrast, defaults to 422)."""
        return cls(event.get("message", "the worker failed"), code=event.get("code") or "worker_failed",
                   default=(503, 2))


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "payload", "query", "path")]
        where = ".".join(loc)
        param = param or where or None
        parts.append(f"{where}: {err.get('msg', 'invalid')}" if where else str(err.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request", param


def install_ninja_handlers(api: Any) -> None:
    """Make every error ``api`` (a NinjaAPI) returns use the Strata shape. Call once per API."""
    from ninja.errors import AuthenticationError, AuthorizationError, HttpError
    from ninja.errors import ValidationError as NinjaValidationError

    def on_app_error(request: HttpRequest, exc: ApplicationError) -> JsonResponse:
        return exc.response()

    def on_validation(request: HttpRequest, exc: NinjaValidationError) -> JsonResponse:
        message, param = _validation_message(list(exc.errors))
        body = error_body(422, message, code="validation_error")
        body["error"]["param"] = param
        return JsonResponse(body, status=422)

    def on_authn(request: HttpRequest, exc: AuthenticationError) -> JsonResponse:
        return error_response(401, "missing or invalid credentials", headers={"WWW-Authenticate": "Bearer"})

    def on_authz(request: HttpRequest, exc: AuthorizationError) -> JsonResponse:
        return error_response(403, str(exc) or "not allowed")

    def on_http(request: HttpRequest, exc: HttpError) -> JsonResponse:
        status = exc.status_code
        if status == 400 and str(exc).startswith("Cannot parse request body"):
            return error_response(400, "request body is not valid JSON", code="invalid_json")
        if status == 403 and "CSRF" in str(exc):
            return error_response(403, "CSRF check failed", code="csrf_failed")
        return error_response(status, str(exc))

    def on_404(request: HttpRequest, exc: Http404) -> JsonResponse:
        return error_response(404, "not found")

    def on_denied(request: HttpRequest, exc: PermissionDenied) -> JsonResponse:
        return error_response(403, str(exc) or "not allowed")

    def on_django_validation(request: HttpRequest, exc: DjangoValidationError) -> JsonResponse:
        return error_response(422, "; ".join(exc.messages), code="invalid_input")

    def on_integrity(request: HttpRequest, exc: IntegrityError) -> JsonResponse:
        logger.info("integrity error mapped to 409: %s", exc)
        return error_response(409, "conflicts with an existing record", code="conflict")

    def on_too_big(request: HttpRequest, exc: RequestDataTooBig) -> JsonResponse:
        return error_response(413, "request body too large")

    def on_suspicious(request: HttpRequest, exc: SuspiciousOperation) -> JsonResponse:
        return error_response(400, "bad request")

    def on_database_down(request: HttpRequest, exc: Exception) -> JsonResponse:
        logger.warning("database unavailable on %s %s: %s", request.method, request.path, exc)
        return database_unavailable_response()

    def on_unexpected(request: HttpRequest, exc: Exception) -> JsonResponse:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error")

    for exc_class, handler in [
        (ApplicationError, on_app_error),
        (NinjaValidationError, on_validation),
        (AuthenticationError, on_authn),
        (AuthorizationError, on_authz),
        (HttpError, on_http),
        (Http404, on_404),
        (PermissionDenied, on_denied),
        (DjangoValidationError, on_django_validation),
        (IntegrityError, on_integrity),
        (OperationalError, on_database_down),
        (InterfaceError, on_database_down),
        (RequestDataTooBig, on_too_big),
        (SuspiciousOperation, on_suspicious),
        (Exception, on_unexpected),
    ]:
        api.add_exception_handler(exc_class, handler)

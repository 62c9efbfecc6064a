"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``, the type named by
the status as Anthropic names it. Strata's own ``code`` rides along in the error object (clients
ignore it; it says which limit or check answered). A 422 (a field Strata's schemas refuse) is a 400,
as Anthropic answers every invalid request."""

from __future__ import annotations

from collections.abc import Mapping

from django.http import JsonResponse

from controlplane.common.errors import ApplicationError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def status_of(status: int) -> int:
    return 400 if status == 422 else status


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, code: str | None = None) -> dict:
    error = {"type": error_type(status_of(status)), "message": message}
    if code:
        error["code"] = code
    return {"type": "error", "error": error}


def error_response(status: int, message: str, code: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JsonResponse:
    response = JsonResponse(error_body(status, message, code), status=status_of(status))
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def from_exception(exc: ApplicationError) -> JsonResponse:
    return error_response(exc.status, exc.message, exc.code, exc.headers)


def from_strata(status: int, body: object) -> tuple[int, dict] | None:
    """The Anthropic status and body of one of Strata's JSON errors (``{"error": {"message", "code"}}``,
    what the gate and the ASGI limits answer); None for a body that is not one (already Anthropic's)."""
    if not isinstance(body, dict) or body.get("type") == "error" or not isinstance(body.get("error"), dict):
        return None
    error = body["error"]
    message = error.get("message") if isinstance(error.get("message"), str) else "request failed"
    code = error.get("code") if isinstance(error.get("code"), str) else None
    return status_of(status), error_body(status, message, code)

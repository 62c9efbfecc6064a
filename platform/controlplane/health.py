"""/healthz (the process answers) and /readyz (it can do useful work).

``/readyz`` checks the database (``SELECT 1``), the Celery broker (a kombu connection with a short
timeout) and the workers through ``controlplane.runtime.workers_ready()`` when that module exists
(absent = ``"not configured"``, which does not fail readiness). 200 when every configured check
passes, else 503 with ``Retry-After`` and the error shape.

Anonymous callers (load balancers, probes) learn only ok / not ok: ``{"status": "ok"}`` or
``{"status": "unavailable", "error": {...}}`` naming no component. The per-check detail (which
dependency, vendor, transport, worker figures) is for operators only: a valid operator bearer token
or a logged-in staff session, checked exactly as the admin API checks them. A caller that cannot be
verified (bad token, or the database needed to check it is down) gets the anonymous answer.

Operators also get ``processes`` when this platform runs under ``make run``: the supervisor's status
file (``workers.process_status``: each child's state, restarts, last exit and last restart). It is
information, not a check: a child being restarted shows there, and readiness is what the checks say.
Likewise ``replicas``: each deployment's replicas and their states (``runtime.replica_states``:
starting with elapsed seconds and phase, ready, failed with its error, stopping, stopped), read
from the replica board and Ray's directory, never by waiting on a replica.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_safe

from controlplane.common.errors import error_body

logger = logging.getLogger("controlplane.health")
BROKER_TIMEOUT_S = 2.0


def _database() -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {"ok": True, "vendor": connection.vendor}


def _broker() -> dict[str, Any]:
    from kombu import Connection

    url = settings.CELERY_BROKER_URL
    with Connection(url, connect_timeout=BROKER_TIMEOUT_S, transport_options={"max_retries": 0}) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=BROKER_TIMEOUT_S)
        return {"ok": True, "transport": conn.transport_cls}


def _workers() -> dict[str, Any]:
    from controlplane import runtime

    answer = runtime.workers_ready()
    if isinstance(answer, dict):
        return {"ok": bool(answer.get("ok")), **{k: v for k, v in answer.items() if k != "ok"}}
    return {"ok": bool(answer)}


def _run(check) -> dict[str, Any]:
    try:
        return check()
    except Exception as exc:  # a failing dependency is a "not ready" answer, never a 500
        logger.warning("readiness check %s failed: %s", check.__name__, exc)
        return {"ok": False, "detail": type(exc).__name__}


def _replicas() -> dict[str, Any] | None:
    from controlplane.runtime.replica_states import deployment_states

    return deployment_states()


def _run_quiet(read) -> Any:
    """``read()``, or None when it fails: information, never a failed readiness or a 500."""
    try:
        return read()
    except Exception as exc:
        logger.info("readyz: %s unavailable (%s)", read.__name__, type(exc).__name__)
        return None


def processes() -> dict[str, Any] | None:
    """``make run``'s supervised children as its supervisor last wrote them (``running``: whether that
    supervisor is alive), or None when this platform was not started by ``make run``."""
    from workers import process_status

    try:
        return process_status.read(process_status.path_in(settings.STRATA_HOME))
    except Exception as exc:  # an unreadable status is no status, never a 500
        logger.info("supervisor status unreadable: %s", type(exc).__name__)
        return None


@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def is_operator(request: HttpRequest) -> bool:
    """Whether ``request`` carries a valid operator token or a staff session (as the admin API
    checks them: bad tokens are audited there). Never raises: unverifiable means not an operator."""
    from controlplane.adminapi.auth import OperatorAuth

    try:
        return OperatorAuth()(request) is not None
    except Exception as exc:  # database down, throttled, denied: the caller gets the anonymous answer
        logger.info("readyz: caller not verified as an operator (%s)", type(exc).__name__)
        return False


@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    checks = {"database": _run(_database), "broker": _run(_broker), "workers": _run(_workers)}
    failing = [name for name, result in checks.items() if result["ok"] is False]
    detailed = is_operator(request)
    extra = {}
    if detailed and (supervised := processes()) is not None:
        extra["processes"] = supervised
    if detailed and checks["workers"]["ok"] and (replicas := _run_quiet(_replicas)) is not None:
        extra["replicas"] = replicas
    if not failing:
        response = JsonResponse({"status": "ok", "checks": checks, **extra} if detailed else {"status": "ok"})
    else:
        message = f"not ready: {', '.join(failing)}" if detailed else "not ready"
        body = {"status": "unavailable", **error_body(503, message, code="not_ready")}
        if detailed:
            body["checks"] = checks
            body.update(extra)
        response = JsonResponse(body, status=503)
        response["Retry-After"] = "5"
    patch_vary_headers(response, ("Authorization", "Cookie"))  # the body depends on who asks
    response["Cache-Control"] = "no-store"
    return response

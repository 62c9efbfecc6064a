"""/healthz (the process answers) and /readyz (it can do useful work).

``/readyz`` checks the database (``SELECT 1``), the Celery broker (a kombu connection with a short
timeout) and the workers through ``controlplane.runtime.workers_ready()`` when that module exists
(absent = ``"not configured"``, which does not fail readiness). 200 when every configured check
passes, else 503 with ``Retry-After`` and the error shape plus the per-check detail.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe

from controlplane.common.errors import error_body
from controlplane.common.hooks import optional_attr

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
    workers_ready = optional_attr("controlplane.runtime", "workers_ready")
    if workers_ready is None:
        return {"ok": None, "detail": "not configured"}
    answer = workers_ready()
    if isinstance(answer, dict):
        return {"ok": bool(answer.get("ok")), **{k: v for k, v in answer.items() if k != "ok"}}
    return {"ok": bool(answer)}


def _run(check) -> dict[str, Any]:
    try:
        return check()
    except Exception as exc:  # a failing dependency is a "not ready" answer, never a 500
        logger.warning("readiness check %s failed: %s", check.__name__, exc)
        return {"ok": False, "detail": type(exc).__name__}


@require_safe
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@require_safe
def readyz(request: HttpRequest) -> JsonResponse:
    checks = {"database": _run(_database), "broker": _run(_broker), "workers": _run(_workers)}
    failing = [name for name, result in checks.items() if result["ok"] is False]
    if not failing:
        return JsonResponse({"status": "ok", "checks": checks})
    body = {"status": "unavailable", "checks": checks,
            **error_body(503, f"not ready: {', '.join(failing)}", code="not_ready")}
    response = JsonResponse(body, status=503)
    response["Retry-After"] = "5"
    return response

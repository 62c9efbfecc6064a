"""Operator UI views: thin callers of selectors and services (see ``access`` for who may do what).

Writes are POST forms with CSRF, answered with a redirect (post/redirect/get). A write the service
refuses (``ApplicationError``) re-renders the page with the error's status, its message and the
operator's input kept. Live regions (``*_live`` views) return partial templates that
``frontend/static/ui/poll.js`` swaps in; the header ``X-Strata-Poll: stop`` ends the polling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.forms import Form
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET

from controlplane.audit.selectors import audit_list, audit_verify
from controlplane.common.errors import ApplicationError
from controlplane.common.query import query_int, query_text
from controlplane.operators.forms import OperatorLoginForm
from controlplane.operators.selectors import login_lockouts_recent
from controlplane.operators.views import lockout_response
from controlplane.runtime.stats import cluster_stats
from controlplane.ui import live_figures, present
from controlplane.ui.access import operator_view
from controlplane.ui.chart_views import dashboard_chartset
from controlplane.ui.forms import form_error_text

POLL_STOP_HEADER = "X-Strata-Poll"
AUDIT_SHOWN = 100
AUDIT_FILTERS = ("action", "actor", "tenant")


class LoginView(auth_views.LoginView):
    """Django's login view; only active staff accounts may log in. Throttled per (account, source)
    and per source and audited (``OperatorLoginForm``): a locked attempt gets the lockout page (429)."""

    template_name = "ui/login.html"
    authentication_form = OperatorLoginForm
    next_page = "ui:dashboard"

    def form_invalid(self, form):
        if form.retry_after is not None:
            return lockout_response(self.request, retry_after=form.retry_after, login_url=reverse("ui:login"))
        return super().form_invalid(form)


class LogoutView(auth_views.LogoutView):
    next_page = "ui:login"


# ---------------------------------------------------------------------- helpers
def _page(request: HttpRequest, template: str, section: str, status: int = 200, **context: Any) -> HttpResponse:
    operator = request.operator
    base = {"operator": operator, "is_admin": operator.is_admin, "section": section}
    return render(request, template, {**base, **context}, status=status)


def _partial(request: HttpRequest, template: str, context: dict, *, final: bool = False) -> HttpResponse:
    response = render(request, template, context)
    response["Cache-Control"] = "no-store"
    if final:
        response[POLL_STOP_HEADER] = "stop"
    return response


def _submit(request: HttpRequest, form: Form, action: Callable[[dict], Any]) -> tuple[Any, int]:
    """``(action(cleaned_data), 200)`` for a valid form the service accepts; otherwise ``(None,
    status)`` with the reason added as an error message (422 for a malformed form)."""
    if not form.is_valid():
        messages.error(request, form_error_text(form))
        return None, 422
    try:
        return action(form.cleaned_data), 200
    except ApplicationError as exc:
        messages.error(request, exc.message)
        return None, exc.status


def _actor(request: HttpRequest):
    return request.operator.actor


# ---------------------------------------------------------------------- dashboard
def _dashboard() -> dict[str, Any]:
    """The live region's figures (the charts are outside it: charts.js refreshes them)."""
    from controlplane.health import processes
    from controlplane.runtime.engine_metrics import engine_rows

    stats = cluster_stats()
    return {"stats": present.dashboard(stats), "capacity": live_figures.capacity_bars(stats),
            "decisions": live_figures.decisions(stats), "processes": processes(),
            "engines": engine_rows(stats["workers"])}


@operator_view
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    from controlplane.serving.health import serving_summary

    return _page(request, "ui/dashboard.html", "dashboard", lockouts=login_lockouts_recent(),
                 serving=serving_summary(), chartset=dashboard_chartset(request.GET.get("range")), **_dashboard())


@operator_view
@require_GET
def dashboard_live(request: HttpRequest) -> HttpResponse:
    return _partial(request, "ui/_dashboard_stats.html", _dashboard())


# tenants (the list, a tenant's page and its status): ``tenant_views``; models and jobs: ``model_views``;
# operator tokens: ``token_views``.


# ---------------------------------------------------------------------- audit
@operator_view
@require_GET
def audit(request: HttpRequest) -> HttpResponse:
    filters = {name: query_text(request.GET.get(name), max_len=150) or None for name in AUDIT_FILTERS}
    raw_before = request.GET.get("before", "").strip()
    before = query_int(raw_before, low=1)  # ASCII digits only: "²".isdigit() is True, int("²") raises
    if raw_before and before is None:
        messages.error(request, "'before' must be an event number; showing the newest events.")
    events = [present.audit_event(e) for e in audit_list(**filters, before_seq=before, limit=AUDIT_SHOWN)]
    verify = audit_verify() if request.GET.get("verify") else None
    older = events[-1]["seq"] if len(events) == AUDIT_SHOWN else None
    return _page(request, "ui/audit.html", "audit", events=events, filters=filters, verify=verify, older=older)

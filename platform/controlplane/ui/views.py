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
from django.forms import Form, Select
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.audit.selectors import audit_list, audit_verify
from controlplane.common.errors import ApplicationError
from controlplane.jobs.selectors import flush_job_get, flush_job_list
from controlplane.jobs.services import flush_job_request, rollout_request
from controlplane.operators.forms import OperatorLoginForm
from controlplane.operators.views import lockout_response
from controlplane.registry.selectors import model_get, model_list
from controlplane.registry.services import revision_create
from controlplane.runtime.stats import cluster_stats
from controlplane.tenants.selectors import tenant_get, tenant_list
from controlplane.tenants.services import tenant_update
from controlplane.ui import present
from controlplane.ui.access import operator_view
from controlplane.ui.forms import FlushForm, RevisionForm, RolloutForm, TenantStatusForm, form_error_text

POLL_STOP_HEADER = "X-Strata-Poll"
JOBS_SHOWN = 50
AUDIT_SHOWN = 100
AUDIT_FILTERS = ("action", "actor", "tenant")


class LoginView(auth_views.LoginView):
    """Django's login view; only active staff accounts may log in. Throttled per account and per
    source and audited (``OperatorLoginForm``): a locked attempt gets the lockout page (429)."""

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
@operator_view
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    return _page(request, "ui/dashboard.html", "dashboard", stats=present.dashboard(cluster_stats()))


@operator_view
@require_GET
def dashboard_live(request: HttpRequest) -> HttpResponse:
    return _partial(request, "ui/_dashboard_stats.html", {"stats": present.dashboard(cluster_stats())})


# ---------------------------------------------------------------------- tenants
def _tenants_page(request: HttpRequest, status: int = 200) -> HttpResponse:
    rows = [present.tenant_row(t) for t in tenant_list()]
    return _page(request, "ui/tenants.html", "tenants", status, tenants=rows)


@operator_view
@require_GET
def tenants(request: HttpRequest) -> HttpResponse:
    return _tenants_page(request)


@operator_view
@require_POST
def tenant_status(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    form = TenantStatusForm(request.POST)
    updated, status = _submit(request, form, lambda d: tenant_update(
        actor=_actor(request), tenant=tenant, status=d["status"], reason=d["reason"]))
    if updated is None:
        return _tenants_page(request, status)
    messages.success(request, f"Tenant {updated.slug} is now {updated.status}.")
    return redirect("ui:tenants")


# ---------------------------------------------------------------------- models
def _form_id(kind: str, name: str) -> str:
    return f"id_{kind}_{name}_%s"


def _models_page(request: HttpRequest, status: int = 200, bound: dict | None = None) -> HttpResponse:
    bound = bound or {}
    rows = []
    for deployment in model_list():
        row = present.model_row(deployment)
        if request.operator.is_admin:
            name = deployment.name
            row["revision_form"] = bound.get(("revision", name)) or RevisionForm(auto_id=_form_id("rev", name))
            rollout = bound.get(("rollout", name)) or RolloutForm(auto_id=_form_id("roll", name))
            rollout.fields["revision"].widget = Select(choices=[(r["label"], r["label"]) for r in row["others"]])
            row["rollout_form"] = rollout
        rows.append(row)
    return _page(request, "ui/models.html", "models", status, models=rows)


@operator_view
@require_GET
def models(request: HttpRequest) -> HttpResponse:
    return _models_page(request)


@operator_view
@require_POST
def revision_add(request: HttpRequest, name: str) -> HttpResponse:
    deployment = model_get(name=name)
    form = RevisionForm(request.POST, auto_id=_form_id("rev", name))
    revision, status = _submit(request, form, lambda d: revision_create(
        actor=_actor(request), deployment=deployment, label=d["label"], seed=d["seed"]))
    if revision is None:
        return _models_page(request, status, bound={("revision", name): form})
    messages.success(request, f"Added revision {revision.label} to {name}. Roll it out when it should serve.")
    return redirect("ui:models")


@operator_view
@require_POST
def rollout(request: HttpRequest, name: str) -> HttpResponse:
    form = RolloutForm(request.POST, auto_id=_form_id("roll", name))
    job, status = _submit(request, form, lambda d: rollout_request(
        actor=_actor(request), model=name, revision=d["revision"], reason=d["reason"]))
    if job is None:
        return _models_page(request, status, bound={("rollout", name): form})
    messages.success(request, f"Rollout of {name} to {job.revision.label} requested.")
    return redirect("ui:job", job_id=job.pk)


# ---------------------------------------------------------------------- jobs
def _recent_jobs() -> list[dict]:
    return [present.job(j) for j in flush_job_list(limit=JOBS_SHOWN)]


def _flush_form(data=None) -> FlushForm:
    return FlushForm(data, tenants=[t.slug for t in tenant_list()], models=[m.name for m in model_list()])


@operator_view
@require_http_methods(["GET", "POST"])
def jobs(request: HttpRequest) -> HttpResponse:
    form, status = None, 200
    if request.method == "POST":
        form = _flush_form(request.POST)
        job, status = _submit(request, form, lambda d: flush_job_request(actor=_actor(request),
                                                                          **form.service_kwargs()))
        if job is not None:
            messages.success(request, f"Flush job {job.pk} requested.")
            return redirect("ui:job", job_id=job.pk)
    flush_form = (form or _flush_form()) if request.operator.is_admin else None
    return _page(request, "ui/jobs.html", "jobs", status, jobs=_recent_jobs(), form=flush_form)


@operator_view
@require_GET
def jobs_live(request: HttpRequest) -> HttpResponse:
    return _partial(request, "ui/_jobs_table.html", {"jobs": _recent_jobs()})


@operator_view
@require_GET
def job_detail(request: HttpRequest, job_id: int) -> HttpResponse:
    return _page(request, "ui/job.html", "jobs", job=present.job(flush_job_get(job_id=job_id)))


@operator_view
@require_GET
def job_live(request: HttpRequest, job_id: int) -> HttpResponse:
    job = present.job(flush_job_get(job_id=job_id))
    return _partial(request, "ui/_job_live.html", {"job": job}, final=job["is_final"])


# ---------------------------------------------------------------------- audit
@operator_view
@require_GET
def audit(request: HttpRequest) -> HttpResponse:
    filters = {name: request.GET.get(name, "").strip()[:150] or None for name in AUDIT_FILTERS}
    before, raw_before = None, request.GET.get("before", "").strip()
    if raw_before:
        if raw_before.isdigit():
            before = int(raw_before)
        else:
            messages.error(request, "'before' must be an event number; showing the newest events.")
    events = [present.audit_event(e) for e in audit_list(**filters, before_seq=before, limit=AUDIT_SHOWN)]
    verify = audit_verify() if request.GET.get("verify") else None
    older = events[-1]["seq"] if len(events) == AUDIT_SHOWN else None
    return _page(request, "ui/audit.html", "audit", events=events, filters=filters, verify=verify, older=older)

"""Operator UI: flush one tenant's cache everywhere from its page, confirmed by typing its slug (as
offboarding is). A thin caller of ``jobs.services.flush_job_request`` (scope ``tenant``, audited as
the operator); the job's page shows its live progress."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_http_methods

from controlplane.jobs.services import flush_job_request
from controlplane.tenants.models import Tenant
from controlplane.tenants.selectors import tenant_get
from controlplane.ui.access import operator_view
from controlplane.ui.tenant_forms import TypedConfirmForm
from controlplane.ui.tenant_views import _actor, _confirm, _posted, _submit


@operator_view
@require_http_methods(["GET", "POST"])
def tenant_flush(request: HttpRequest, slug: str) -> HttpResponse:
    """GET: the confirmation page; POST (admin): with the slug typed, queue a flush of every block of
    the tenant on every worker and tier, and open the job."""
    tenant = tenant_get(slug=slug)
    form = TypedConfirmForm(_posted(request), expected=tenant.slug, what="the tenant's slug")
    status = 200
    if request.method == "POST":
        job, status = _submit(form, lambda d: flush_job_request(
            actor=_actor(request), scope="tenant", tenant=tenant,
            reason=d["reason"] or "flushed from the operator console"))
        if job is not None:
            messages.success(request, f"Flush job {job.pk} requested for {tenant.slug}.")
            return redirect("ui:job", job_id=job.pk)
    lines = [f"Every cached block of {tenant.slug} ({tenant.name}) leaves every worker and tier (L1, L2 and "
             "L3); its keys and named caches stay, and its next requests compute their prompts again."]
    if tenant.status == Tenant.Status.OFFBOARDED:
        lines.append("It is offboarded: its offboarding job already flushed it; this asks again.")
    return _confirm(request, tenant, status, form=form, title=f"Flush {tenant.slug}", lines=lines,
                    button=f"Flush {tenant.slug}")

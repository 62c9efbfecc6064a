"""Tenant pages of the operator UI: the list (search, create) and one tenant's page (quotas and
cache policy, share group, API keys, grants, data keys, offboarding, its cache usage from the ledger
and its live named caches, its jobs and audit events).

Thin callers of the same services as the admin API (``tenants.services``, ``tenants.access``,
``tenants.datakeys``), with the operator's ``Actor`` (``request.operator.actor``: name, ``session``,
source address), so every change is audited exactly as through the API. ``ui.access.operator_view``
wraps every view: viewers read everything and any POST of theirs is a 403, audited.

Writes are POST forms answered with a redirect, except creating an API key: its raw key is rendered
once in the POST response itself (``Cache-Control: no-store``), never stored (not in the session,
not in a message) and never shown by any GET. A form the service refuses is shown again with the
service's message next to the field it is about and the refusal's status (422, 409, ...).
Destructive actions (revoking a key, shredding a data-key version, offboarding) go through a
confirmation page; shredding and offboarding need the version / slug typed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.db import transaction
from django.db.models import Q
from django.forms import Form
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.adapters.selectors import tenant_adapters
from controlplane.adminapi.datakeys import data_key_out
from controlplane.adminapi.present import key_out, share_group_out
from controlplane.adminapi.tenants import tenant_out
from controlplane.audit.selectors import audit_list
from controlplane.common.errors import ApplicationError, NotFound
from controlplane.common.query import query_text
from controlplane.jobs.selectors import flush_job_list
from controlplane.registry.selectors import model_get, model_list
from controlplane.tenants import access, datakeys, services
from controlplane.tenants.models import DataKey, Tenant
from controlplane.tenants.selectors import (
    api_key_get,
    api_key_list,
    grant_list,
    share_group_get,
    share_group_list,
    tenant_get,
    tenant_list,
)
from controlplane.ui import present
from controlplane.ui.access import operator_view
from controlplane.ui.chart_views import chartset, tenant_chartset
from controlplane.ui.forms import TenantStatusForm, form_error_text
from controlplane.ui.ledger_charts import cache_usage
from controlplane.ui.tenant_forms import (
    GrantForm,
    KeyCreateForm,
    ReasonForm,
    ShareGroupCreateForm,
    ShareGroupJoinForm,
    TenantCreateForm,
    TenantSettingsForm,
    TypedConfirmForm,
    apply_service_error,
)

SEARCH_MAX = 100
STATUSES = [s.value for s in Tenant.Status]
JOBS_SHOWN = 10
JOBS_SCANNED = 500  # flush_job_list has no tenant filter: the tenant's among the newest 500
AUDIT_SHOWN = 20
KEY_FORMS_REMEMBERED = 50
# Several forms share the tenant page: each gets its own element ids (``settings_name``, ``key_name``...).
IDS = {name: f"{name.removesuffix('_form')}_%s" for name in (
    "settings_form", "key_form", "grant_form", "join_form", "group_form", "leave_form", "rotate_form")}
USED_KEY_FORMS = "ui_key_forms_used"  # session: the ``once`` values of key forms already run (never a key)


# ---------------------------------------------------------------------- helpers
def _page(request: HttpRequest, template: str, status: int = 200, **context: Any) -> HttpResponse:
    operator = request.operator
    base = {"operator": operator, "is_admin": operator.is_admin, "section": "tenants"}
    return render(request, template, {**base, **context}, status=status)


def _submit(form: Form, action: Callable[[dict], Any]) -> tuple[Any, int]:
    """``(action(cleaned_data), 200)``, or ``(None, status)`` with the errors on ``form`` (422 for a
    malformed form, the ``ApplicationError``'s status for a refusal)."""
    if not form.is_valid():
        return None, 422
    try:
        return action(form.cleaned_data), 200
    except ApplicationError as exc:
        apply_service_error(form, exc)
        return None, exc.status


def _actor(request: HttpRequest):
    return request.operator.actor


def _posted(request: HttpRequest):
    """The form data of a POST (bound even when empty), ``None`` for a GET (an unbound form)."""
    return request.POST if request.method == "POST" else None


def _to_tenant(tenant: Tenant) -> HttpResponse:
    return redirect("ui:tenant", slug=tenant.slug)


# ---------------------------------------------------------------------- list and create
def _list_page(request: HttpRequest, status: int = 200, form: TenantCreateForm | None = None) -> HttpResponse:
    query = query_text(request.GET.get("q"), max_len=SEARCH_MAX)  # no NUL: PostgreSQL refuses it
    wanted = request.GET.get("status", "")
    tenants = tenant_list(status=wanted if wanted in STATUSES else None)
    if query:
        tenants = tenants.filter(Q(slug__icontains=query) | Q(name__icontains=query))
    rows = [present.tenant_row(t) for t in tenants]
    create_form = (form or TenantCreateForm()) if request.operator.is_admin else None
    return _page(request, "ui/tenants.html", status, tenants=rows, create_form=create_form, q=query,
                 status_filter=wanted if wanted in STATUSES else "", statuses=STATUSES, searched=bool(query or wanted))


def _create(request: HttpRequest, form: TenantCreateForm) -> Tenant:
    """``tenant_create`` then, for a cache policy other than the default, ``tenant_update`` (the API's
    POST then PATCH), in one transaction: both land, with their audit events, or neither."""
    data = form.cleaned_data
    with transaction.atomic():
        tenant = services.tenant_create(actor=_actor(request), slug=data["slug"], name=data["name"],
                                        quotas=form.quotas())
        return services.tenant_update(actor=_actor(request), tenant=tenant, cache_policy=form.cache_policy())


@operator_view
@require_http_methods(["GET", "POST"])
def tenants(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _list_page(request)
    form = TenantCreateForm(request.POST)
    tenant, status = _submit(form, lambda d: _create(request, form))
    if tenant is None:
        return _list_page(request, status, form)
    messages.success(request, f"Created tenant {tenant.slug}. Issue it an API key and grant it a model.")
    return _to_tenant(tenant)


# ---------------------------------------------------------------------- the tenant page
def _tenant_jobs(tenant: Tenant) -> list[dict]:
    """The tenant's newest jobs as the Jobs page shows them (``present.job_page``: with ``tier_totals``,
    the blocks and bytes each freed)."""
    jobs = [j for j in flush_job_list(limit=JOBS_SCANNED) if j.tenant_id == tenant.pk]
    return [present.job_page(j) for j in jobs[:JOBS_SHOWN]]


def _detail(request: HttpRequest, tenant: Tenant, status: int = 200, **bound: Form) -> HttpResponse:
    """The tenant page; ``bound`` holds a refused form (by its context name) to show with its errors."""
    tenant = tenant_get(slug=tenant.slug)  # fresh, with its share group
    info = tenant_out(tenant)
    keys = [key_out(k) for k in api_key_list(tenant=tenant)]
    granted = [g.deployment.name for g in grant_list(tenant=tenant)]
    data_keys = [data_key_out(k) for k in datakeys.data_key_list(tenant=tenant)]
    group = share_group_out(share_group_get(slug=info["share_group"])) if info["share_group"] else None
    groups = [share_group_out(g) for g in share_group_list()]
    usable = tenant.status != Tenant.Status.OFFBOARDED
    forms: dict[str, Form | None] = {}
    if request.operator.is_admin:
        others = [m.name for m in model_list().order_by("name") if m.name not in granted]
        forms = {
            "settings_form": TenantSettingsForm.for_tenant(tenant, auto_id=IDS["settings_form"]) if usable else None,
            "key_form": KeyCreateForm(auto_id=IDS["key_form"]) if usable else None,
            "grant_form": GrantForm(models=others, auto_id=IDS["grant_form"]) if usable and others else None,
            "join_form": (ShareGroupJoinForm(groups=[(g["slug"], f"{g['slug']} — {g['name']}") for g in groups],
                                             auto_id=IDS["join_form"])
                          if usable and group is None and groups else None),
            "group_form": ShareGroupCreateForm(auto_id=IDS["group_form"]) if usable and group is None else None,
            "leave_form": ReasonForm(auto_id=IDS["leave_form"]) if group is not None else None,
            "rotate_form": ReasonForm(auto_id=IDS["rotate_form"]) if usable else None,
        }
        for name, form in bound.items():
            if forms.get(name) is not None:
                forms[name] = form  # shown where it was, with its errors next to its fields
            else:  # not offered in the tenant's state now (e.g. it joined a group meanwhile)
                messages.error(request, form_error_text(form))
    from controlplane.serving.health import serving_summary

    usage = cache_usage(tenant)
    return _page(
        request, "ui/tenant_detail.html", status, tenant=info, quota_list=present.quota_list(info["quotas"]),
        usable=usable, keys=keys, granted=granted,
        data_keys=data_keys, group=group, has_groups=bool(groups),
        active_keys=sum(1 for k in keys if k["revoked_at"] is None),
        # a tenant that cannot be served yet: its key and grant forms first (its charts are empty)
        next_steps=bool(forms) and usable and (not granted or all(k["revoked_at"] for k in keys)),
        jobs=_tenant_jobs(tenant),
        adapters=present.adapter_rows(tenant_adapters(tenant), tenant=tenant),
        chartset=tenant_chartset(tenant.slug, request.GET.get("range")),
        usage=usage,
        usage_charts=chartset("cache-usage-charts", usage["charts"]),
        serving=serving_summary(tenant.slug),
        events=[present.audit_event(e) for e in audit_list(tenant=tenant.slug, limit=AUDIT_SHOWN)],
        **forms,
    )


@operator_view
@require_POST
def tenant_status(request: HttpRequest, slug: str) -> HttpResponse:
    """Suspend or reactivate (from the tenant's page or the list); a refusal re-renders the list."""
    tenant = tenant_get(slug=slug)
    form = TenantStatusForm(request.POST)
    updated, status = _submit(form, lambda d: services.tenant_update(
        actor=_actor(request), tenant=tenant, status=d["status"], reason=d["reason"]))
    if updated is None:
        messages.error(request, form_error_text(form))
        return _list_page(request, status)
    messages.success(request, f"Tenant {updated.slug} is now {updated.status}.")
    return redirect("ui:tenants")


@operator_view
@require_GET
def tenant_detail(request: HttpRequest, slug: str) -> HttpResponse:
    return _detail(request, tenant_get(slug=slug))


@operator_view
@require_POST
def tenant_settings(request: HttpRequest, slug: str) -> HttpResponse:
    """Name, quotas and cache policy: one ``tenant_update`` (one audit event per kind of change)."""
    tenant = tenant_get(slug=slug)
    before = (tenant.name, tenant.quotas, tenant.cache_policy)
    form = TenantSettingsForm(request.POST, auto_id=IDS["settings_form"])
    updated, status = _submit(form, lambda d: services.tenant_update(
        actor=_actor(request), tenant=tenant, name=d["name"], quotas=form.quotas(),
        cache_policy=form.cache_policy(), reason=d["reason"]))
    if updated is None:
        return _detail(request, tenant, status, settings_form=form)
    if (updated.name, updated.quotas, updated.cache_policy) == before:
        messages.info(request, "Nothing changed.")
    else:
        messages.success(request, f"Saved the quotas and cache policy of {updated.slug}.")
    return _to_tenant(updated)


# ---------------------------------------------------------------------- API keys
def _remember_key_form(request: HttpRequest, once: str) -> bool:
    """True the first time ``once`` (a key form's random value) is seen in this session."""
    used = list(request.session.get(USED_KEY_FORMS, []))
    if once in used:
        return False
    request.session[USED_KEY_FORMS] = [*used, once][-KEY_FORMS_REMEMBERED:]
    return True


@operator_view
@require_POST
def key_create(request: HttpRequest, slug: str) -> HttpResponse:
    """A new key, shown once in this response (no-store). Re-sending the same form (a reload of
    that page) makes no key and shows none: it lands on the tenant page with a warning."""
    tenant = tenant_get(slug=slug)
    form = KeyCreateForm(request.POST, auto_id=IDS["key_form"])
    if form.is_valid() and not _remember_key_form(request, form.cleaned_data["once"]):
        messages.warning(request, "That key was shown once and cannot be shown again. If it was not copied, "
                                  "revoke it and create a new one.")
        return _to_tenant(tenant)
    created, status = _submit(form, lambda d: services.api_key_create(actor=_actor(request), tenant=tenant,
                                                                      name=d["name"]))
    if created is None:
        return _detail(request, tenant, status, key_form=form)
    key, raw = created
    response = _page(request, "ui/tenant_key_created.html", tenant=tenant_out(tenant), key=key_out(key), raw_key=raw)
    add_never_cache_headers(response)  # Cache-Control: max-age=0, no-cache, no-store, must-revalidate, private
    response["Pragma"] = "no-cache"
    response["Referrer-Policy"] = "no-referrer"
    return response


@operator_view
@require_http_methods(["GET", "POST"])
def key_revoke(request: HttpRequest, slug: str, key_id: int) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    key = api_key_get(tenant=tenant, key_id=key_id)
    form = ReasonForm(_posted(request))
    status = 200
    if request.method == "POST":
        revoked, status = _submit(form, lambda d: services.api_key_revoke(actor=_actor(request), api_key=key,
                                                                          reason=d["reason"]))
        if revoked is not None:
            messages.success(request, f"Revoked key {revoked.prefix}…; requests with it now get 401.")
            return _to_tenant(tenant)
    return _confirm(request, tenant, status, form=form if key.revoked_at is None else None,
                    title=f"Revoke key {key.prefix}…",
                    lines=[f"Key {key.prefix}…{f' ({key.name})' if key.name else ''} of tenant {tenant.slug} "
                           "stops working at once: every request with it gets 401. This cannot be undone."],
                    done=f"Key {key.prefix}… is already revoked." if key.revoked_at else "",
                    button="Revoke key")


def _confirm(request: HttpRequest, tenant: Tenant, status: int = 200, **context: Any) -> HttpResponse:
    return _page(request, "ui/tenant_confirm.html", status, tenant=tenant_out(tenant), **context)


# ---------------------------------------------------------------------- grants
@operator_view
@require_POST
def grant_add(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    form = GrantForm(request.POST, models=[m.name for m in model_list()], auto_id=IDS["grant_form"])
    grant, status = _submit(form, lambda d: access.grant_create(actor=_actor(request), tenant=tenant,
                                                                deployment=model_get(name=d["model"])))
    if grant is None:
        return _detail(request, tenant, status, grant_form=form)
    messages.success(request, f"Granted model {grant.deployment.name} to {tenant.slug}.")
    return _to_tenant(tenant)


@operator_view
@require_POST
def grant_remove(request: HttpRequest, slug: str, model: str) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    access.grant_delete(actor=_actor(request), tenant=tenant, deployment=model_get(name=model))
    messages.success(request, f"Withdrew model {model} from {tenant.slug}; its requests for it now get 404.")
    return _to_tenant(tenant)


# ---------------------------------------------------------------------- share groups
@operator_view
@require_POST
def share_group_join(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    form = ShareGroupJoinForm(request.POST, groups=[(g.slug, g.slug) for g in share_group_list()],
                              auto_id=IDS["join_form"])
    joined, status = _submit(form, lambda d: access.share_group_add(
        actor=_actor(request), group=share_group_get(slug=d["group"]), tenant=tenant, reason=d["reason"]))
    if joined is None:
        return _detail(request, tenant, status, join_form=form)
    messages.success(request, f"{tenant.slug} joined share group {form.cleaned_data['group']}.")
    return _to_tenant(tenant)


@operator_view
@require_POST
def share_group_new(request: HttpRequest, slug: str) -> HttpResponse:
    """Create a share group and put this tenant in it: both services in one transaction."""
    tenant = tenant_get(slug=slug)
    form = ShareGroupCreateForm(request.POST, auto_id=IDS["group_form"])

    def create_and_join(d: dict) -> Tenant:
        with transaction.atomic():
            group = access.share_group_create(actor=_actor(request), slug=d["slug"], name=d["name"])
            return access.share_group_add(actor=_actor(request), group=group, tenant=tenant)

    joined, status = _submit(form, create_and_join)
    if joined is None:
        return _detail(request, tenant, status, group_form=form)
    messages.success(request, f"Created share group {form.cleaned_data['slug']} with {tenant.slug} in it.")
    return _to_tenant(tenant)


@operator_view
@require_POST
def share_group_leave(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    form = ReasonForm(request.POST, auto_id=IDS["leave_form"])
    group = tenant.share_group
    if group is None:
        raise NotFound(f"tenant {tenant.slug!r} is in no share group", code="share_group_not_found")
    left, status = _submit(form, lambda d: access.share_group_remove(actor=_actor(request), group=group,
                                                                     tenant=tenant, reason=d["reason"]))
    if left is None:
        return _detail(request, tenant, status, leave_form=form)
    messages.success(request, f"{tenant.slug} left share group {group.slug}; a flush job clears the blocks it "
                              "created.")
    return _to_tenant(tenant)


# ---------------------------------------------------------------------- data keys
@operator_view
@require_POST
def data_key_rotate(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    form = ReasonForm(request.POST, auto_id=IDS["rotate_form"])
    key, status = _submit(form, lambda d: datakeys.data_key_rotate(actor=_actor(request), tenant=tenant,
                                                                   reason=d["reason"]))
    if key is None:
        return _detail(request, tenant, status, rotate_form=form)
    messages.success(request, f"Data key v{key.version} of {tenant.slug} is now active; new L3 objects use it.")
    return _to_tenant(tenant)


@operator_view
@require_http_methods(["GET", "POST"])
def data_key_shred(request: HttpRequest, slug: str, version: int) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    key = datakeys.data_key_get(tenant=tenant, version=version)  # 404 for an unknown version
    form = TypedConfirmForm(_posted(request), expected=str(version), what="the version number")
    status = 200
    if request.method == "POST":
        job, status = _submit(form, lambda d: datakeys.data_key_shred(actor=_actor(request), tenant=tenant,
                                                                      version=version, reason=d["reason"]))
        if job is not None:
            messages.success(request, f"Shred of data key v{version} of {tenant.slug} requested (job {job.pk}).")
            return redirect("ui:job", job_id=job.pk)
    lines = [f"Every L3 object of {tenant.slug} encrypted with data key v{version} becomes unreadable for good: "
             "the wrapped key is deleted, every worker drops the key and its objects, then a probe verifies "
             "they miss."]
    if key.state == DataKey.State.ACTIVE and tenant.status != Tenant.Status.OFFBOARDED:
        lines.append(f"v{version} is the active version: a new version is made active first.")
    if key.state == DataKey.State.SHREDDED:
        lines.append(f"v{version} is already shredded; this runs the job again (drop and verify everywhere).")
    return _confirm(request, tenant, status, form=form, title=f"Shred data key v{version}", lines=lines,
                    button=f"Shred v{version}")


# ---------------------------------------------------------------------- named caches
@operator_view
@require_POST
def named_cache_delete(request: HttpRequest, slug: str, cache_id: str) -> HttpResponse:
    """Delete one of the tenant's live named caches (``caches.services.cache_delete``: audited, its
    pins and bytes dropped). Another tenant's cache, or one already gone, is a 404."""
    from controlplane.caches.selectors import cache_get
    from controlplane.caches.services import cache_delete

    tenant = tenant_get(slug=slug)
    cache = cache_get(tenant, cache_id)
    if cache is None:
        raise NotFound(f"named cache {cache_id!r} not found", code="cache_not_found")
    reason = query_text(request.POST.get("reason"), max_len=1000) or "deleted in the operator console"
    cache_delete(cache, actor=_actor(request), reason=reason)
    messages.success(request, f"Deleted named cache {cache.display_name or cache.public_id} of {tenant.slug}.")
    return _to_tenant(tenant)


# ---------------------------------------------------------------------- offboarding
@operator_view
@require_http_methods(["GET", "POST"])
def tenant_offboard(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_get(slug=slug)
    form = TypedConfirmForm(_posted(request), expected=tenant.slug, what="the tenant's slug")
    status = 200
    if request.method == "POST":
        result, status = _submit(form, lambda d: services.tenant_offboard(actor=_actor(request), tenant=tenant,
                                                                          reason=d["reason"]))
        if result is not None:
            messages.success(request, f"Offboarded {tenant.slug}: {result.keys_revoked} key(s) revoked; the job "
                                      "flushes its caches and shreds its data keys everywhere.")
            if result.flush_job is not None:
                return redirect("ui:job", job_id=result.flush_job.pk)
            return _to_tenant(tenant)
    lines = [f"{tenant.slug} ({tenant.name}) loses access for good: every API key is revoked at once, its caches "
             "are flushed on every worker and every version of its data key is crypto-shredded. It cannot be "
             "reactivated."]
    if tenant.status == Tenant.Status.OFFBOARDED:
        lines.append("It is already offboarded; this requests the offboard job again.")
    return _confirm(request, tenant, status, form=form, title=f"Offboard {tenant.slug}", lines=lines,
                    button=f"Offboard {tenant.slug}")

"""Operator UI: models (create a deployment, add revisions, roll out) and jobs (request a flush of
any scope; every job with live progress, per-worker and per-tier results, steps and verification).

Thin callers of the same services as the admin API (``registry.services``, ``jobs.services``), so
every change is audited with the operator's name, ``session`` and source address exactly as an API
call is. Writes are POST forms (CSRF; admins only, see ``access.operator_view``) answered with a
redirect; a form the service refuses is re-rendered with the operator's input, the error next to
the field it concerns and as a message at the top, under the error's status (422 for a malformed
form).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.forms import Form, Select
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.adapters.selectors import adapters_by_deployment
from controlplane.common.errors import ApplicationError
from controlplane.jobs.models import FlushJob
from controlplane.jobs.selectors import flush_job_get, flush_job_list
from controlplane.jobs.services import flush_job_request, rollout_request
from controlplane.registry.selectors import model_get, model_list
from controlplane.registry.services import model_create, model_set_replicas, revision_create
from controlplane.runtime.capacity import capacity_by_model
from controlplane.runtime.replica_states import replica_states
from controlplane.tenants.selectors import tenant_list
from controlplane.ui import present
from controlplane.ui.access import operator_view
from controlplane.ui.capacity_hints import capacity_rows
from controlplane.ui.forms import (
    FlushForm,
    ModelCreateForm,
    ReplicasForm,
    RevisionForm,
    RollbackForm,
    RolloutForm,
    adapter_delete_form,
    delete_forms,
    form_error_text,
)
from controlplane.ui.views import _page, _partial

JOBS_SHOWN = 50
ROLLOUTS_READ = 500  # rollout jobs read to derive revision states (newest first)
JOB_KINDS = tuple(FlushJob.Kind.values)


def submit(request: HttpRequest, form: Form, action: Callable[[dict], Any],
           fields: dict[str, str] | None = None) -> tuple[Any, int]:
    """``(action(cleaned_data), 200)`` for a valid form the service accepts; otherwise ``(None,
    status)``. Form errors stay next to their fields; a service refusal is put next to the field it
    names (``fields`` maps error codes to field names; a message that starts with a field's name
    goes there too) and always shown as a message at the top (422 for a malformed form)."""
    if not form.is_valid():
        messages.error(request, form_error_text(form))
        return None, 422
    try:
        return action(form.cleaned_data), 200
    except ApplicationError as exc:
        messages.error(request, exc.message)
        field = (fields or {}).get(exc.code) or next(
            (name for name in form.fields if exc.message.startswith((f"{name}:", f"{name} "))), None)
        if field in form.fields:
            form.add_error(field, exc.message)
        return None, exc.status


def _actor(request: HttpRequest):
    return request.operator.actor


# ---------------------------------------------------------------------- models
REVISION_ERRORS = {"invalid_weights_path": "weights_path", "invalid_revision_source": "seed", "conflict": "label",
                   "invalid_checkpoint": "path"}
MODEL_ERRORS = {**REVISION_ERRORS, "unknown_preset": "preset", "conflict": "name", "invalid_engine": "engine"}
ROLLOUT_ERRORS = {"revision_not_found": "revision", "already_active": "revision",
                  "rollback_not_confirmed": "confirm"}


def _form_id(kind: str, name: str) -> str:
    return f"id_{kind}_{name}_%s"


def _models_page(request: HttpRequest, status: int = 200, bound: dict | None = None) -> HttpResponse:
    bound = bound or {}
    rollouts = list(flush_job_list(kind=FlushJob.Kind.ROLLOUT, limit=ROLLOUTS_READ))
    rows = []
    deployments = list(model_list())
    capacity = capacity_by_model(deployments)  # the replicas' last samples: never waits on a replica
    adapters: dict[str, list[dict]] = {}
    for a in present.adapter_rows([a for group in adapters_by_deployment(deployments).values() for a in group]):
        adapters.setdefault(a["model"], []).append(a)
    for deployment in deployments:
        row = present.model_page_row(deployment, rollouts)
        row["adapters"] = adapters.get(deployment.name, [])
        row["stopped"] = deployment.replicas == 0
        row["replica_states"] = replica_states(deployment.name, deployment.replicas)  # never waits on a replica
        row["capacity"] = capacity_rows(capacity.get(deployment.name, []))
        if request.operator.is_admin:
            name = deployment.name
            row["revision_form"] = bound.get(("revision", name)) or RevisionForm(auto_id=_form_id("rev", name))
            row.update(delete_forms(name, row["revisions"], row["active_revision"], bound))
            row["delete_adapter_form"] = adapter_delete_form(name, row["adapters"], bound)
            labels = [r["label"] for r in row["revisions"]]
            at = labels.index(row["active_revision"]) if row["active_revision"] in labels else -1
            newer = list(reversed(row["revisions"][at + 1:]))  # newest first: the default is the newest
            older = list(reversed(row["revisions"][:max(at, 0)]))
            rollout_form = bound.get(("rollout", name)) or RolloutForm(
                auto_id=_form_id("roll", name), initial={"revision": newer[0]["label"] if newer else ""})
            rollout_form.fields["revision"].widget = Select(
                choices=[(r["label"], f"{r['label']} ({r['state']})") for r in newer])
            row["rollout_form"], row["newer"] = rollout_form, newer
            if older:
                rollback_form = bound.get(("rollback", name)) or RollbackForm(auto_id=_form_id("back", name))
                rollback_form.fields["revision"].widget = Select(
                    choices=[(r["label"], f"{r['label']} ({r['state']})") for r in older])
                row["rollback_form"] = rollback_form
            row["replicas_form"] = bound.get(("replicas", name)) or ReplicasForm(
                auto_id=_form_id("rep", name), initial={"replicas": deployment.replicas})
            # its less used forms are folded away, open when one of them was refused (shown with its errors)
            row["open"] = any(isinstance(key, tuple) and key[1] == name for key in bound)
        rows.append(row)
    create_form = (bound.get("create") or ModelCreateForm(auto_id="id_new_%s")) if request.operator.is_admin else None
    return _page(request, "ui/models.html", "models", status, models=rows, create_form=create_form)


@operator_view
@require_http_methods(["GET", "POST"])
def models(request: HttpRequest) -> HttpResponse:
    """GET: every deployment and its revisions; POST (admin): create a deployment and its first
    revision (``model_create``, audited ``model.create``), on the engine chosen (``auto``: the
    default rule of ``registry.engines``)."""
    if request.method != "POST":
        return _models_page(request)
    form = ModelCreateForm(request.POST, auto_id="id_new_%s")
    deployment, status = submit(request, form, lambda d: model_create(
        actor=_actor(request), name=d["name"], preset=d["preset"] or "", revision=form.revision_kwargs(),
        engine=d.get("engine") or None), MODEL_ERRORS)
    if deployment is None:
        return _models_page(request, status, bound={"create": form})
    source = f"preset {deployment.preset}" if deployment.preset else f"{deployment.architecture} checkpoint"
    source += f", engine {deployment.engine}"
    messages.success(request, f"Created model {deployment.name} ({source}); "
                              f"revision {deployment.active_revision.label} is active. Grant it to tenants.")
    return redirect(f"{reverse('ui:models')}#m-{deployment.name}")


@operator_view
@require_POST
def revision_add(request: HttpRequest, name: str) -> HttpResponse:
    """Add a revision by seed or weights path (``revision_create``); it serves once rolled out."""
    deployment = model_get(name=name)
    form = RevisionForm(request.POST, auto_id=_form_id("rev", name))
    revision, status = submit(request, form, lambda d: revision_create(
        actor=_actor(request), deployment=deployment, **form.revision_kwargs()), REVISION_ERRORS)
    if revision is None:
        return _models_page(request, status, bound={("revision", name): form})
    messages.success(request, f"Added revision {revision.label} to {name}. Roll it out when it should serve.")
    return redirect("ui:models")


@operator_view
@require_POST
def rollout(request: HttpRequest, name: str) -> HttpResponse:
    """"Model updated — reset the cache": the rollout job (``rollout_request``); opens its live page."""
    form = RolloutForm(request.POST, auto_id=_form_id("roll", name))
    job, status = submit(request, form, lambda d: rollout_request(
        actor=_actor(request), model=name, revision=d["revision"], reason=d["reason"]), ROLLOUT_ERRORS)
    if job is None:
        return _models_page(request, status, bound={("rollout", name): form})
    messages.success(request, f"Rollout of {name} to {job.revision.label} requested.")
    return redirect("ui:job", job_id=job.pk)


@operator_view
@require_POST
def rollback(request: HttpRequest, name: str) -> HttpResponse:
    """Back to an older revision: the same rollout job, asked for as a rollback with the model's name
    typed (``rollout_request``'s check); its job says from and to."""
    form = RollbackForm(request.POST, auto_id=_form_id("back", name))
    job, status = submit(request, form, lambda d: rollout_request(
        actor=_actor(request), model=name, revision=d["revision"], reason=d["reason"] or "rollback", rollback=True,
        confirm=d["confirm"]), ROLLOUT_ERRORS)
    if job is None:
        return _models_page(request, status, bound={("rollback", name): form})
    messages.success(request, f"Rollback of {name} from {job.from_revision.label} to {job.revision.label} requested.")
    return redirect("ui:job", job_id=job.pk)


@operator_view
@require_POST
def replicas(request: HttpRequest, name: str) -> HttpResponse:
    """Scale a deployment (``model_set_replicas``, audited ``model.scale``): up starts replicas, down
    drains the extra ones, 0 (the Stop button) stops it, the Start button asks for 1."""
    deployment = model_get(name=name)
    form = ReplicasForm(request.POST, auto_id=_form_id("rep", name))
    scaled, status = submit(request, form, lambda d: model_set_replicas(
        actor=_actor(request), deployment=deployment, replicas=d["replicas"], reason=d["reason"]),
        {"invalid_replicas": "replicas"})
    if scaled is None:
        return _models_page(request, status, bound={("replicas", name): form})
    if scaled.replicas == 0:
        messages.success(request, f"{name} is stopping: its replicas drain and stop in the background; tenants "
                                  f"get 503 model_stopped until it is started again. Its cached KV in L3 stays.")
    else:
        messages.success(request, f"{name} now runs {scaled.replicas} replica(s); new ones start and removed ones "
                                  f"drain in the background.")
    return redirect(f"{reverse('ui:models')}#m-{name}")


# ---------------------------------------------------------------------- jobs
FLUSH_ERRORS = {"tenant_required": "tenant", "tenant_not_found": "tenant", "model_required": "model",
                "model_not_found": "model", "revision_required": "revision", "revision_not_found": "revision",
                "reason_required": "reason", "invalid_scope": "scope"}


def _kind(request: HttpRequest) -> str | None:
    kind = request.GET.get("kind", "").strip()
    return kind if kind in JOB_KINDS else None


def _recent_jobs(kind: str | None) -> list[dict]:
    return [present.job_page(j) for j in flush_job_list(kind=kind, limit=JOBS_SHOWN)]


def _flush_form(data=None) -> FlushForm:
    return FlushForm(data, tenants=[t.slug for t in tenant_list()], models=[m.name for m in model_list()])


def _live_url(kind: str | None) -> str:
    url = reverse("ui:jobs-live")
    return f"{url}?kind={kind}" if kind else url


@operator_view
@require_http_methods(["GET", "POST"])
def jobs(request: HttpRequest) -> HttpResponse:
    """GET: every job (flush, rollout, offboard, shred; ``?kind=`` filters) with live progress;
    POST (admin): request a flush of any scope with a reason (``flush_job_request``)."""
    form, status, kind = None, 200, _kind(request)
    if request.method == "POST":
        form = _flush_form(request.POST)
        job, status = submit(request, form, lambda d: flush_job_request(
            actor=_actor(request), **form.service_kwargs()), FLUSH_ERRORS)
        if job is not None:
            messages.success(request, f"Flush job {job.pk} requested.")
            return redirect("ui:job", job_id=job.pk)
    flush_form = (form or _flush_form()) if request.operator.is_admin else None
    return _page(request, "ui/jobs.html", "jobs", status, jobs=_recent_jobs(kind), form=flush_form,
                 kind=kind, kinds=JOB_KINDS, live_url=_live_url(kind))


@operator_view
@require_GET
def jobs_live(request: HttpRequest) -> HttpResponse:
    return _partial(request, "ui/_jobs_table.html", {"jobs": _recent_jobs(_kind(request))})


@operator_view
@require_GET
def job_detail(request: HttpRequest, job_id: int) -> HttpResponse:
    return _page(request, "ui/job.html", "jobs", job=present.job_page(flush_job_get(job_id=job_id)))


@operator_view
@require_GET
def job_live(request: HttpRequest, job_id: int) -> HttpResponse:
    job = present.job_page(flush_job_get(job_id=job_id))
    return _partial(request, "ui/_job_live.html", {"job": job}, final=job["is_final"])

"""Operator UI: deleting a model or one of its inactive revisions, each confirmed by typing the
model's name (as a rollback is), or one of its LoRA adapters, confirmed by typing the adapter's name.
Thin callers of ``jobs.deletes`` and ``adapters.services.adapter_delete``: the request is audited with
the operator's name like an admin API call, and the job's page shows its live progress."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from controlplane.adapters import selectors as adapter_selectors
from controlplane.adapters.services import adapter_delete as adapter_delete_job
from controlplane.jobs.deletes import model_delete_request, revision_delete_request
from controlplane.registry.selectors import model_get
from controlplane.ui.access import operator_view
from controlplane.ui.forms import DeleteAdapterForm, DeleteModelForm, DeleteRevisionForm
from controlplane.ui.model_views import _actor, _models_page, submit

DELETE_ERRORS = {"delete_not_confirmed": "confirm", "reason_required": "reason", "revision_active": "revision",
                 "revision_not_found": "revision", "revision_in_rollout": "revision",
                 "adapter_not_found": "adapter"}


@operator_view
@require_POST
def model_delete(request: HttpRequest, name: str) -> HttpResponse:
    """Delete a deployment (``model_delete_request``): it leaves the page at once; opens its job."""
    model_get(name=name)  # 404 for a model that is not there
    form = DeleteModelForm(request.POST, auto_id=f"id_del_{name}_%s")
    job, status = submit(request, form, lambda d: model_delete_request(
        actor=_actor(request), model=name, reason=d["reason"], confirm=d["confirm"]), DELETE_ERRORS)
    if job is None:
        return _models_page(request, status, bound={("delete", name): form})
    messages.success(request, f"Deleting {name}: tenants get 404 from now on; job {job.pk} stops its replicas "
                              f"and removes its cache everywhere.")
    return redirect("ui:job", job_id=job.pk)


@operator_view
@require_POST
def revision_delete(request: HttpRequest, name: str) -> HttpResponse:
    """Delete a revision that is not active (``revision_delete_request``); opens its job."""
    model_get(name=name)
    form = DeleteRevisionForm(request.POST, auto_id=f"id_delrev_{name}_%s")
    job, status = submit(request, form, lambda d: revision_delete_request(
        actor=_actor(request), model=name, revision=d["revision"], reason=d["reason"], confirm=d["confirm"]),
        DELETE_ERRORS)
    if job is None:
        return _models_page(request, status, bound={("delete-revision", name): form})
    messages.success(request, f"Deleting revision {job.revision.label} of {name}: job {job.pk} removes its cache.")
    return redirect("ui:job", job_id=job.pk)


@operator_view
@require_POST
def adapter_delete(request: HttpRequest, name: str) -> HttpResponse:
    """Delete one of ``name``'s adapters (``adapters.services.adapter_delete``): tenants get 404 for it at
    once; its job removes its KV from every tier. Opens the job."""
    deployment = model_get(name=name)
    form = DeleteAdapterForm(request.POST, auto_id=f"id_deladp_{name}_%s")
    job, status = submit(request, form, lambda d: adapter_delete_job(
        actor=_actor(request), reason=d["reason"],
        adapter=adapter_selectors.adapter_get(deployment=deployment, name=d["adapter"])), DELETE_ERRORS)
    if job is None:
        return _models_page(request, status, bound={("delete-adapter", name): form})
    messages.success(request, f"Deleting adapter {job.adapter.name} of {name}: tenants get 404 for it from now on; "
                              f"job {job.pk} removes its cache everywhere.")
    return redirect("ui:job", job_id=job.pk)

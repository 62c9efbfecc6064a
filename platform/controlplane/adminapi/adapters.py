"""/api/admin/models/{name}/adapters: a model's LoRA adapters (register, list, delete through a job)."""

from __future__ import annotations

from ninja import Router, Status

from controlplane.adapters import selectors, services
from controlplane.adapters.models import Adapter
from controlplane.adminapi.auth import actor_of
from controlplane.adminapi.schemas import AdapterIn, AdapterOut, AdapterReplaceIn
from controlplane.registry.selectors import model_get
from controlplane.tenants.selectors import tenant_get

router = Router(tags=["adapters"])


def adapter_out(a: Adapter) -> dict:
    return {"name": a.name, "model": a.deployment.name, "tenant": a.tenant.slug if a.tenant_id else None,
            "digest": a.digest, "rank": a.rank, "alpha": a.alpha, "target_modules": list(a.target_modules),
            "dtype": a.dtype, "path": a.path, "state": a.state, "created": a.created}


@router.post("models/{name}/adapters", response={201: AdapterOut})
def create_adapter(request, name: str, payload: AdapterIn):
    deployment = model_get(name=name)
    tenant = tenant_get(slug=payload.tenant) if payload.tenant else None
    adapter = services.adapter_create(actor=actor_of(request), deployment=deployment, name=payload.name,
                                      path=payload.path, tenant=tenant)
    return Status(201, adapter_out(adapter))


@router.get("models/{name}/adapters", response=list[AdapterOut])
def list_adapters(request, name: str):
    return [adapter_out(a) for a in selectors.adapter_list(deployment=model_get(name=name))]


@router.put("models/{name}/adapters/{adapter}", response={202: dict})
def replace_adapter(request, name: str, adapter: str, payload: AdapterReplaceIn):
    """New files under the adapter's name: served at once in a new scope (``replacement``: the new
    registration); the job (``adapter_delete`` of the old one) removes the old scope's KV from every
    tier, verified."""
    from controlplane.jobs.selectors import flush_job_view

    found = selectors.adapter_get(deployment=model_get(name=name), name=adapter)
    new, job = services.adapter_replace(actor=actor_of(request), adapter=found, path=payload.path,
                                        reason=payload.reason)
    return Status(202, {"replacement": adapter_out(new), "job": {"id": job.pk, "status": job.status},
                        **flush_job_view(job)})


@router.delete("models/{name}/adapters/{adapter}", response={202: dict})
def delete_adapter(request, name: str, adapter: str, reason: str = ""):
    """Stops serving the adapter at once; the job (``adapter_delete``) removes its KV from every tier
    of every replica, verifies it, then frees the name."""
    from controlplane.jobs.selectors import flush_job_view

    found = selectors.adapter_get(deployment=model_get(name=name), name=adapter)
    job = services.adapter_delete(actor=actor_of(request), adapter=found, reason=reason[:2000])
    return Status(202, {"job": {"id": job.pk, "status": job.status}, **flush_job_view(job)})

"""/api/admin/models: deployments and their weight revisions (rollout lives in the jobs app)."""

from __future__ import annotations

import json

from ninja import Router, Status

from controlplane.adminapi.auth import actor_of
from controlplane.adminapi.present import model_out, revision_out
from controlplane.adminapi.schemas import (
    ModelCreateIn,
    ModelDetailOut,
    ModelOut,
    ModelPatchIn,
    RevisionIn,
    RevisionOut,
)
from controlplane.common.errors import InvalidInput
from controlplane.jobs import deletes
from controlplane.jobs.selectors import flush_job_view
from controlplane.registry import selectors, services
from controlplane.runtime import capacity

router = Router(tags=["models"])


@router.post("models", response={201: ModelOut})
def create_model(request, payload: ModelCreateIn):
    deployment = services.model_create(
        actor=actor_of(request), name=payload.name, preset=payload.preset or "",
        revision=payload.revision.model_dump(), architecture=payload.architecture, tokenizer=payload.tokenizer,
        engine=payload.engine, tensor_parallel_size=payload.tensor_parallel_size,
    )
    if payload.replicas != deployment.replicas:
        services.model_set_replicas(actor=actor_of(request), deployment=deployment, replicas=payload.replicas)
    return Status(201, model_out(selectors.model_get(name=deployment.name)))


@router.patch("models/{name}", response=ModelOut)
def patch_model(request, name: str, payload: ModelPatchIn):
    """Scale a deployment: ``replicas`` 0..16. Up starts replicas (in the background: the answer does
    not wait for them); down drains the extra ones; 0 stops the deployment (503 ``model_stopped``).
    ``engine`` is fixed at creation: the current value is accepted, another is 409 ``engine_fixed``."""
    deployment = selectors.model_get(name=name)
    if payload.engine is not None:
        services.model_check_engine(deployment=deployment, engine=payload.engine)
    if payload.replicas is not None:
        services.model_set_replicas(actor=actor_of(request), deployment=deployment, replicas=payload.replicas,
                                    reason=payload.reason)
    return model_out(selectors.model_get(name=name))


@router.get("models", response=list[ModelOut])
def list_models(request):
    return [model_out(d) for d in selectors.model_list()]


@router.get("models/{name}", response=ModelDetailOut)
def get_model(request, name: str):
    """The deployment, with ``replica_states`` (``runtime.replica_states``) and each replica's KV
    capacity in tokens and sequences of its context (from the replica's last stats sample): neither
    waits on a replica."""
    from controlplane.runtime.replica_states import replica_states

    deployment = selectors.model_get(name=name)
    return {**model_out(deployment), "replica_states": replica_states(deployment.name, deployment.replicas),
            "capacity": capacity.deployment_capacity(deployment)}


@router.post("models/{name}/revisions", response={201: RevisionOut})
def create_revision(request, name: str, payload: RevisionIn):
    deployment = selectors.model_get(name=name)
    revision = services.revision_create(
        actor=actor_of(request), deployment=deployment, label=payload.label, seed=payload.seed,
        weights_path=payload.weights_path, path=payload.path,
    )
    return Status(201, revision_out(revision, deployment.active_revision_id))


def _delete_reason(request, reason: str) -> str:
    """The reason of a DELETE: ``?reason=`` (as offboarding and shredding take it) or a JSON body
    ``{"reason"}``; a body that is not such an object is 422."""
    if not request.body:
        return reason
    try:
        body = json.loads(request.body)
    except ValueError:
        raise InvalidInput("the body must be JSON: {\"reason\": \"...\"}", code="invalid_json") from None
    if not isinstance(body, dict) or set(body) - {"reason"} or not isinstance(body.get("reason", ""), str):
        raise InvalidInput("the body may only hold {\"reason\": \"...\"}")
    return body.get("reason") or reason


@router.delete("models/{name}", response={202: dict})
def delete_model(request, name: str, reason: str = ""):
    """Delete a deployment (a reason is required): 202 with its ``model_delete`` job (follow it at
    ``flush-jobs/{id}``). From now on tenants get 404 ``model_not_found`` and lists leave it out; the
    job stops its requests, flushes it everywhere, stops every replica, deletes its L3 objects and
    ends its grants. While it runs, a DELETE answers the same job; after a job that did not succeed,
    a new one; once deleted, 404. The name can be used again once the job succeeded."""
    job = deletes.model_delete_request(actor=actor_of(request), model=name, reason=_delete_reason(request, reason))
    return Status(202, {"job": {"id": job.pk, "status": job.status}, **flush_job_view(job)})


@router.delete("models/{name}/revisions/{label}", response={202: dict})
def delete_revision(request, name: str, label: str, reason: str = ""):
    """Delete a revision that is not active (409 ``revision_active``): 202 with its
    ``revision_delete`` job, which removes its KV from every tier. It is no longer listed, and a
    rollout to it is a 404."""
    job = deletes.revision_delete_request(actor=actor_of(request), model=name, revision=label,
                                          reason=_delete_reason(request, reason))
    return Status(202, {"job": {"id": job.pk, "status": job.status}, **flush_job_view(job)})

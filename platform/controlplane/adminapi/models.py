"""/api/admin/models: deployments and their weight revisions (rollout lives in the jobs app)."""

from __future__ import annotations

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

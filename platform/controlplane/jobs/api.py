"""/api/admin/flush-jobs and /api/admin/models/{name}/rollout (mounted by adminapi.api)."""

from __future__ import annotations

from typing import Literal

from ninja import Router, Schema, Status
from pydantic import ConfigDict, Field

from controlplane.adminapi.auth import actor_of
from controlplane.common.query import QueryText
from controlplane.jobs import selectors, services

router = Router(tags=["jobs"])


class FlushJobIn(Schema):
    model_config = ConfigDict(extra="forbid")

    scope: Literal["tenant", "model", "revision", "all"]
    reason: str = Field(min_length=1, max_length=2000)
    tenant: str | None = None
    model: str | None = None
    revision: str | None = None


class RolloutIn(Schema):
    model_config = ConfigDict(extra="forbid")

    revision: str = Field(min_length=1, max_length=64)
    reason: str = Field(default="", max_length=2000)
    # Rolling back to a revision older than the active one must be said twice: rollback true and
    # the model's name typed in confirm (else 409 rollback_not_confirmed).
    rollback: bool = False
    confirm: str = Field(default="", max_length=200)


@router.post("flush-jobs", response={202: dict})
def request_flush(request, payload: FlushJobIn):
    job = services.flush_job_request(actor=actor_of(request), scope=payload.scope, reason=payload.reason,
                                     tenant=payload.tenant, model=payload.model, revision=payload.revision)
    return Status(202, selectors.flush_job_view(job))


@router.get("flush-jobs", response=list[dict])
def list_jobs(request, status: QueryText | None = None, kind: QueryText | None = None, limit: int = 100):
    return [selectors.flush_job_view(j) for j in selectors.flush_job_list(status=status, kind=kind, limit=limit)]


@router.get("flush-jobs/{job_id}", response=dict)
def get_job(request, job_id: int):
    return selectors.flush_job_view(selectors.flush_job_get(job_id=job_id))


@router.post("models/{name}/rollout", response={202: dict})
def rollout(request, name: str, payload: RolloutIn):
    job = services.rollout_request(actor=actor_of(request), model=name, revision=payload.revision,
                                   reason=payload.reason, rollback=payload.rollback, confirm=payload.confirm)
    return Status(202, {"job": {"id": job.pk, "status": job.status}, **selectors.flush_job_view(job)})

"""Read side of jobs."""

from __future__ import annotations

from django.db.models import QuerySet

from controlplane.common.errors import NotFound
from controlplane.jobs.models import FlushJob


def flush_job_list(*, status: str | None = None, kind: str | None = None, limit: int = 100) -> QuerySet[FlushJob]:
    qs = FlushJob.objects.select_related("tenant", "deployment", "revision", "from_revision")
    if status:
        qs = qs.filter(status=status)
    if kind:
        qs = qs.filter(kind=kind)
    return qs[: max(1, min(limit, 500))]


def flush_job_get(*, job_id: int) -> FlushJob:
    job = FlushJob.objects.select_related("tenant", "deployment", "revision", "from_revision").filter(pk=job_id).first()
    if job is None:
        raise NotFound(f"job {job_id} not found", code="job_not_found")
    return job


def flush_job_view(job: FlushJob) -> dict:
    """The public shape of a job (admin API and UI)."""
    return {
        "id": job.pk,
        "kind": job.kind,
        "scope": job.scope,
        "tenant": job.tenant.slug if job.tenant_id else None,
        "model": job.deployment.name if job.deployment_id else None,
        "revision": job.revision.label if job.revision_id else None,
        "from_revision": job.from_revision.label if job.from_revision_id else None,
        "version": job.key_version,  # shred: the data-key version
        "adapter": job.adapter.name if job.adapter_id else None,  # adapter_delete: the adapter
        "reason": job.reason,
        "requested_by": job.requested_by,
        "status": job.status,
        "progress": {"done": job.progress_done, "total": job.progress_total},
        "results": [{"worker": name, **res} for name, res in sorted(job.results.items())],
        "verified": job.verified,
        "error": job.error,
        "attempts": job.attempts,
        "steps": job.steps,
        "created_at": job.created_at.isoformat(),
        "started_at": job.started_at.isoformat() if job.started_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
    }

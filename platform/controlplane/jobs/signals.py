"""Resume jobs whose Celery worker died: when a worker starts, re-enqueue running jobs whose
heartbeat is stale. Execution is idempotent, so a job that is in fact still running elsewhere (or
whose message the broker also redelivers) completes once, with no double effects."""

from __future__ import annotations

import logging
from datetime import timedelta

from celery.signals import worker_ready
from django.conf import settings
from django.utils import timezone

logger = logging.getLogger("controlplane.jobs")


def resume_stale_jobs() -> list[int]:
    from controlplane.jobs.models import FlushJob
    from controlplane.jobs.tasks import run_job

    stale = timezone.now() - timedelta(seconds=getattr(settings, "STRATA_JOB_STALE_SECONDS", 60))
    ids = list(FlushJob.objects.filter(status=FlushJob.Status.RUNNING, heartbeat_at__lt=stale)
               .values_list("pk", flat=True))
    for job_id in ids:
        logger.info("resuming stale job %s", job_id)
        run_job.delay(job_id)
    return ids


@worker_ready.connect
def _on_worker_ready(**_kwargs) -> None:
    try:
        resume_stale_jobs()
    except Exception:  # never keep a worker from starting
        logger.exception("could not resume stale jobs")

"""Celery tasks: take an id, re-read the row, call the service. Idempotent, acks_late, retried."""

from __future__ import annotations

import logging

from celery import shared_task

from controlplane.jobs import services
from controlplane.jobs.models import FlushJob

logger = logging.getLogger("controlplane.jobs")

MAX_RETRIES = 6


@shared_task(bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=MAX_RETRIES, name=services.RUN_JOB)
def run_job(self, job_id: int) -> str:
    """Run flush/rollout/offboard job ``job_id`` to a final state; unreachable workers are retried with
    exponential backoff, and the last attempt records what is still failing (partial/failed)."""
    final = self.request.retries >= self.max_retries
    try:
        job = services.job_execute(job_id=job_id, final_attempt=final)
    except FlushJob.DoesNotExist:
        logger.warning("job %s does not exist; dropping the message", job_id)
        return "missing"
    except services.RetryLater as exc:
        raise self.retry(exc=exc, countdown=min(2 ** self.request.retries, 30)) from exc
    except Exception as exc:  # a bug or an outage: retry, and never leave the job "running" forever
        logger.exception("job %s failed", job_id)
        if final:
            return services.job_fail(job_id=job_id, error=f"{type(exc).__name__}: {exc}").status
        raise self.retry(exc=exc, countdown=min(2 ** self.request.retries, 30)) from exc
    return job.status

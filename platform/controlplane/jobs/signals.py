"""Resume jobs whose Celery worker died.

Every Celery worker runs a small reaper thread: every few seconds it re-enqueues running jobs whose
heartbeat is stale (the worker executing them stopped updating it) and jobs still queued a staleness
window after they were requested (the broker did not take their message), and refreshes their
heartbeat so each is re-enqueued once per staleness window. Execution is idempotent (per-worker results are
recorded and skipped on resume; a final job is never touched again), so a job that was in fact still
alive, or whose message the broker also redelivers, completes once with no double effects.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from celery.signals import worker_ready
from django.conf import settings
from django.db import close_old_connections
from django.db.models import Q
from django.utils import timezone

logger = logging.getLogger("controlplane.jobs")

QUEUED_RESEND_SECONDS = 30.0


def stale_seconds() -> float:
    return float(getattr(settings, "STRATA_JOB_STALE_SECONDS", 60))


def resume_stale_jobs() -> list[int]:
    from controlplane.jobs.models import FlushJob
    from controlplane.jobs.services import job_send

    now = timezone.now()
    before = now - timedelta(seconds=stale_seconds())
    running = Q(status=FlushJob.Status.RUNNING, heartbeat_at__lt=before)
    # A job still queued a while after it was requested (or last sent) never reached a worker: the
    # broker was down when it was requested (services._send_or_leave_queued), or lost the message. At
    # least QUEUED_RESEND_SECONDS: a job merely waiting behind another in a busy worker is not resent.
    unsent = now - timedelta(seconds=max(stale_seconds(), QUEUED_RESEND_SECONDS))
    queued = Q(status=FlushJob.Status.QUEUED, created_at__lt=unsent) & (Q(heartbeat_at__isnull=True)
                                                                        | Q(heartbeat_at__lt=unsent))
    stale = FlushJob.objects.filter(running | queued)
    ids = list(stale.values_list("pk", flat=True))
    if ids:
        FlushJob.objects.filter(pk__in=ids).update(heartbeat_at=now)
    for job_id in ids:
        logger.info("resuming stale job %s", job_id)
        job_send(job_id)
    return ids


def _reaper() -> None:
    while True:
        try:
            resume_stale_jobs()
        except Exception:  # the database may be briefly away; try again next round
            logger.exception("could not check for stale jobs")
        finally:
            close_old_connections()
        time.sleep(max(1.0, stale_seconds() / 2))


@worker_ready.connect
def _on_worker_ready(**_kwargs) -> None:
    threading.Thread(target=_reaper, name="strata-job-reaper", daemon=True).start()

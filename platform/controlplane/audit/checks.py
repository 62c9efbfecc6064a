"""The audit chain verified on a schedule, and the last result kept for ``/metrics``.

``audit_verify`` (selectors) reads the whole chain; nothing ran it unless an operator asked, so a
broken chain stayed silent. Here every Celery worker runs a small thread (started on ``worker_ready``,
as the job reaper is) that, every ``poll`` seconds, tries to claim the next run; the claim is one
conditional UPDATE of the :class:`~controlplane.audit.models.AuditCheck` row, so across every Celery
worker of a database at most one run starts per interval (``STRATA_AUDIT_CHECK_SECONDS`` in Django
settings, default one hour). The run verifies and records the result; ``manage.py audit_verify``
records its result too. A run that dies half-way leaves its claim: the next one is due an interval
after it, and ``strata_audit_verify_timestamp_seconds`` ageing past a few intervals is what says so.

Contract of the row (``audit_check_status``): ``None`` until a run has finished; then ``ok``,
``checked_at`` (when that run finished), ``length``, ``first_bad``, ``problem`` of the last run and
``failures``, the number of runs that ever found the chain broken.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta
from typing import TypedDict

from celery.signals import worker_ready
from django.conf import settings
from django.db import IntegrityError, close_old_connections, transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.audit.models import AuditCheck
from controlplane.audit.selectors import VerifyResult, audit_verify

logger = logging.getLogger("controlplane.audit")

DEFAULT_CHECK_SECONDS = 3600


class CheckStatus(TypedDict):
    ok: bool
    checked_at: datetime
    length: int
    first_bad: int | None
    problem: str
    failures: int


def check_seconds() -> float:
    """How often the chain is verified (``STRATA_AUDIT_CHECK_SECONDS``, a Django setting, >= 1)."""
    return max(1.0, float(getattr(settings, "STRATA_AUDIT_CHECK_SECONDS", DEFAULT_CHECK_SECONDS)))


def _row() -> None:
    """Make sure the single row exists (two processes may race to create it: one wins)."""
    if not AuditCheck.objects.filter(pk=1).exists():
        try:
            with transaction.atomic():
                AuditCheck.objects.create(pk=1)
        except IntegrityError:
            pass


def audit_check_claim(*, interval_seconds: float | None = None, now: datetime | None = None) -> bool:
    """Claim the next run: True for exactly one caller per interval, whichever process it is in (a
    conditional UPDATE: the database lets one claimer match the row)."""
    _row()
    now = now or timezone.now()
    interval = check_seconds() if interval_seconds is None else interval_seconds
    due = Q(claimed_at__isnull=True) | Q(claimed_at__lte=now - timedelta(seconds=interval))
    return AuditCheck.objects.filter(due, pk=1).update(claimed_at=now) == 1


def audit_check_record(*, result: VerifyResult, at: datetime | None = None) -> None:
    """Keep ``result`` as the last verification (``failures`` + 1 when it found the chain broken)."""
    _row()
    fields = {"checked_at": at or timezone.now(), "ok": result["ok"], "length": result["length"],
              "first_bad": result["first_bad"], "problem": result["problem"] or ""}
    if not result["ok"]:
        fields["failures"] = F("failures") + 1
    AuditCheck.objects.filter(pk=1).update(**fields)


def audit_check_run() -> VerifyResult:
    """Verify the chain now and record the result."""
    result = audit_verify()
    audit_check_record(result=result)
    if not result["ok"]:
        logger.error("audit chain broken at seq %s: %s", result["first_bad"], result["problem"])
    return result


def audit_check_status() -> CheckStatus | None:
    """The last finished run (one row; ``None`` before the first)."""
    row = AuditCheck.objects.filter(pk=1, checked_at__isnull=False).first()
    if row is None:
        return None
    return {"ok": row.ok, "checked_at": row.checked_at, "length": row.length, "first_bad": row.first_bad,
            "problem": row.problem, "failures": row.failures}


def run_due() -> bool:
    """One round of the checker: claim, and run when the claim was won. True when it ran."""
    if not audit_check_claim():
        return False
    audit_check_run()
    return True


def _checker(stopped: threading.Event) -> None:
    poll = min(60.0, check_seconds() / 4)
    while not stopped.is_set():
        try:
            run_due()
        except Exception:  # the database may be briefly away; the claim is retried next round
            logger.exception("could not verify the audit chain")
        finally:
            close_old_connections()
        stopped.wait(poll)


@worker_ready.connect
def _on_worker_ready(**_kwargs) -> None:
    threading.Thread(target=_checker, args=(threading.Event(),), name="strata-audit-check", daemon=True).start()

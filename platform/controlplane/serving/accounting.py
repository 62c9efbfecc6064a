"""After a completion finished: its usage into the tenant's ledger, its prompt into the tenant's
miss-diagnostics history, and the diagnosis the client asked for.

Runs in a sync thread (database, hashing). Never fails the request: a ledger or history error is
logged and the response goes out without it (the request was served; the figure is what is lost).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from controlplane.caches import diagnostics
from controlplane.serving import responses

logger = logging.getLogger("controlplane.serving")


def _flushes(tenant_id: int, deployment_name: str):
    """``since -> job id | None``: the newest flush, rollout or offboarding covering this tenant's
    cache of ``deployment_name`` that finished after ``since``."""

    def newest(since: float) -> str | None:
        from django.db.models import Q

        from controlplane.jobs.models import FlushJob

        job = (FlushJob.objects.filter(status__in=(FlushJob.Status.SUCCEEDED, FlushJob.Status.PARTIAL),
                                       finished_at__gt=datetime.fromtimestamp(since, UTC))
               .filter(Q(scope="all") | Q(scope="tenant", tenant_id=tenant_id)
                       | Q(scope__in=("model", "revision"), deployment__name=deployment_name))
               .order_by("-finished_at").values_list("pk", flat=True).first())
        return None if job is None else str(job)

    return newest


def account(prep, finished: dict, ledger: list[dict] | None = None) -> dict | None:
    """Ledger and history for ``prep``'s finished event; the diagnosis when it was asked for. With
    ``ledger`` the ledger's record is appended there instead of written (the accountant writes a
    batch's records together: ``ledger.services.ledger_record_many``)."""
    acc = prep.accounting
    if acc is None:
        return None
    diagnosis = None
    try:
        diagnosis = diagnostics.diagnose(diagnostics.Request(
            tenant=str(acc.tenant_id), tenant_salt=acc.tenant_salt, model=prep.model,
            cache_salt=prep.worker_req.get("cache_salt"), tokens=prep.tokens,
            block_size=int(finished["usage"].get("block_size") or acc.block_size),
            revision=str(finished.get("revision") or acc.revision), persist=acc.persist,
            retention_seconds=acc.retention_seconds, usage=finished["usage"], parts=acc.parts),
            flushes=_flushes(acc.tenant_id, prep.spec.deployment))  # an adapter's base deployment too
    except Exception:
        logger.exception("cache diagnosis failed")
    try:
        from controlplane.ledger.services import ledger_record

        record = {"tenant_id": acc.tenant_id, "model": prep.model, "usage": responses.usage(finished),
                  "misses": diagnostics.misses(diagnosis) if diagnosis else None}
        if ledger is not None:
            ledger.append(record)
        else:
            ledger_record(**record)
    except Exception:
        logger.exception("ledger record failed")
    return diagnosis if acc.diagnostics else None

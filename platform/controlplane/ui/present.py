"""Selector results shaped for templates (read-only; no writes, no Ray calls of its own).

Reuses the admin API's shapes (``adminapi.present``, ``jobs.selectors.flush_job_view``) so the UI
and the API never disagree; adds only what a page needs on top (bars, timestamps, targets).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from controlplane.adminapi.present import audit_event_out, model_out, tenant_out
from controlplane.audit.models import AuditEvent
from controlplane.jobs.models import FlushJob
from controlplane.jobs.selectors import flush_job_view
from controlplane.registry.models import ModelDeployment
from controlplane.tenants.models import Tenant
from controlplane.tenants.selectors import api_key_list

POOL_PARTS = ("protected", "evictable", "free")
RESULT_SHOWN = ("worker", "status", "blocks_freed", "reason")


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 1) if whole else 0.0


def dashboard(stats: dict) -> dict:
    """``runtime.stats.cluster_stats()`` plus page-pool bars per worker."""
    workers = []
    for worker in stats["workers"]:
        row = {"model": worker["model"], "status": worker["status"]}
        if worker["status"] == "ok":
            pool = worker.get("pool", {})
            total = int(pool.get("total", 0))
            row.update(
                revision=worker.get("worker", {}).get("revision", ""),
                totals=worker["totals"],
                pool={part: int(pool.get(part, 0)) for part in POOL_PARTS},
                pool_total=total,
                bar=[(part, _pct(int(pool.get(part, 0)), total)) for part in POOL_PARTS],
                block_size=pool.get("block_size"),
            )
        workers.append(row)
    return {"totals": stats["totals"], "tenants": stats["tenants"], "workers": workers}


def tenant_row(tenant: Tenant) -> dict[str, Any]:
    keys = list(api_key_list(tenant=tenant))
    return {
        **tenant_out(tenant),
        "keys": [{"prefix": k.prefix, "name": k.name, "revoked": k.is_revoked} for k in keys],
    }


def model_row(deployment: ModelDeployment) -> dict[str, Any]:
    out = model_out(deployment)
    out["active"] = next((r for r in out["revisions"] if r["active"]), None)
    out["others"] = [r for r in out["revisions"] if not r["active"]]
    return out


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def job_target(view: dict) -> str:
    if view["scope"] == FlushJob.Scope.TENANT:
        return f"tenant {view['tenant']}"
    if view["kind"] == FlushJob.Kind.ROLLOUT:
        return f"{view['model']}: {view['from_revision'] or '—'} → {view['revision']}"
    if view["scope"] == FlushJob.Scope.REVISION:
        return f"{view['model']}@{view['revision']}"
    if view["scope"] == FlushJob.Scope.MODEL:
        return f"model {view['model']}"
    return "every model"


def job(job: FlushJob) -> dict[str, Any]:
    """``flush_job_view`` plus datetimes, a target line, a percentage and display-ready results/steps."""
    view = flush_job_view(job)
    done, total = view["progress"]["done"], view["progress"]["total"]
    view.update(
        is_final=job.is_final,
        target=job_target(view),
        percent=_pct(done, total),
        created=job.created_at, started=job.started_at, finished=job.finished_at,
        results=[{**{k: r.get(k) for k in RESULT_SHOWN},
                  "details": {k: v for k, v in r.items() if k not in RESULT_SHOWN}} for r in view["results"]],
        steps=[{"at": _when(s.get("at")), "step": s.get("step", ""),
                "details": {k: v for k, v in s.items() if k not in ("at", "step")}} for s in view["steps"]],
    )
    return view


def audit_event(event: AuditEvent) -> dict[str, Any]:
    return audit_event_out(event)

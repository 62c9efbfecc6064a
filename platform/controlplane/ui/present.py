"""Selector results shaped for templates (read-only; no writes, no Ray calls of its own).

Reuses the admin API's shapes (``adminapi.present``, ``jobs.selectors.flush_job_view``) so the UI
and the API never disagree; adds only what a page needs on top (bars, timestamps, targets).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone

from controlplane.adminapi.adapters import adapter_out
from controlplane.adminapi.present import audit_event_out, model_out, tenant_out
from controlplane.audit.models import AuditEvent
from controlplane.jobs.models import FlushJob
from controlplane.jobs.selectors import flush_job_view
from controlplane.ledger.selectors import model_sums
from controlplane.registry.models import ModelDeployment
from controlplane.tenants import quotas as quota_registry
from controlplane.tenants.models import Tenant
from controlplane.tenants.selectors import api_key_list

POOL_PARTS = ("protected", "evictable", "free")
TIER_LABELS = {"l1": "device pages", "l2": "host memory", "l3": "remote store"}
TOKEN_LAYERS = (  # (label, tokens key, ratio key): docs/design.md section 2's layers, kept apart
    ("Index held (lookup hit)", "lookup_hit_tokens", "lookup_hit_ratio"),
    ("Bytes arrived (load success)", "load_success_tokens", "load_success_ratio"),
    ("Prefill skipped (effective hit)", "effective_hit_tokens", "effective_hit_ratio"),
)
RESULT_SHOWN = ("worker", "status", "blocks_freed", "reason")


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 1) if whole else 0.0


def human_bytes(n: int | float | None) -> str:
    """1536 -> '1.5 KiB' (binary units; a dash for None)."""
    if n is None:
        return "—"
    value = float(n)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def latency(seconds: float | None) -> str:
    """A load latency for display: '—' before any load was timed, else ms (µs below 1 ms)."""
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    return f"{seconds * 1e3:.1f} ms"


def tier_row(name: str, tier: dict) -> dict[str, Any]:
    """One row of the per-tier table (cluster sums of ``cluster_stats()["tiers"][name]``)."""
    capacity, used = int(tier.get("capacity_blocks", 0)), int(tier.get("used_blocks", 0))
    lat = tier.get("load_latency") or {}
    return {
        "name": name,
        "label": TIER_LABELS.get(name, name.upper()),
        **{k: tier.get(k, 0) for k in ("hits", "hit_tokens", "failures", "corrupt_loads", "late_loads",
                                       "fallbacks_to_recompute", "promotions", "demotions", "evictions")},
        "capacity_blocks": capacity,
        "used_blocks": used,
        "used_pct": _pct(used, capacity),
        "capacity_bytes": human_bytes(tier.get("capacity_bytes", 0)),
        "used_bytes": human_bytes(tier.get("used_bytes", 0)),
        "bytes_in": human_bytes(tier.get("bytes_in", 0)),
        "bytes_out": human_bytes(tier.get("bytes_out", 0)),
        "p50": latency(lat.get("p50")),
        "p99": latency(lat.get("p99")),
    }


def dashboard(stats: dict) -> dict:
    """``runtime.stats.cluster_stats()`` plus page-pool bars per worker, a per-tier table, the token
    layers and each tenant's resident bytes per tier (display-ready)."""
    workers = []
    for worker in stats["workers"]:
        row = {"model": worker["model"], "status": worker["status"], "stale": worker.get("stale", False),
               "age_s": worker.get("age_s")}
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
    tiers = stats.get("tiers") or {}
    names = list(tiers) or ["l1"]
    totals = stats["totals"]
    tenants = [{**t, "resident": [(name, human_bytes((t.get("resident_bytes") or {}).get(name, 0)))
                                  for name in names]} for t in stats["tenants"]]
    return {
        "totals": totals,
        "layers": [{"label": label, "tokens": totals.get(key, 0), "ratio": totals.get(ratio, 0.0)}
                   for label, key, ratio in TOKEN_LAYERS],
        "tiers": [tier_row(name, tier) for name, tier in tiers.items()],
        "tier_names": [(name, name.upper()) for name in names],
        "tenants": tenants,
        "workers": workers,
    }


def quota_list(values: dict[str, Any]) -> list[dict[str, Any]]:
    """A tenant's quotas (``tenant_out(...)["quotas"]``) for a read-only page, in registry order:
    ``label`` (the form's), ``short`` (the tenants list's), ``value``, ``null`` (what a null shows) and
    ``limit`` (null means unlimited: the limits the tenants list shows)."""
    return [{"name": s.name, "label": s.label, "short": s.short or s.label, "value": values.get(s.name),
             "null": s.null_display, "limit": s.unlimited} for s in quota_registry.QUOTAS]


def tenant_row(tenant: Tenant) -> dict[str, Any]:
    keys = list(api_key_list(tenant=tenant))
    out = tenant_out(tenant)
    return {
        **out,
        "quota_list": quota_list(out["quotas"]),
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


# ---------------------------------------------------------------------- models, jobs and tokens pages
REVISION_STATES = {  # state -> what it means, for the badge's title
    "active": "serving: new requests run on these weights",
    "rolling out": "a rollout to this revision is in progress",
    "staged": "added, never served yet: roll it out to serve it",
    "retired": "served before; a rollout replaced it and freed its cache",
}
TIER_RESULT_KEYS = ("worker", "status", "blocks_freed", "reason", "tiers", "l3_bytes", "bytes", "objects")


def revision_states(deployment: ModelDeployment, rollouts: list[FlushJob]) -> dict[str, str]:
    """Each revision's state as the registry and its rollout jobs know it: ``active`` (the
    deployment's active revision), ``rolling out`` (target of a rollout not final yet), ``retired``
    (replaced by a rollout that switched the active revision), else ``staged``."""
    switched = {j.from_revision_id for j in rollouts
                if j.from_revision_id and any(s.get("step") == "switched" for s in j.steps)}
    pending = {j.revision_id for j in rollouts if not j.is_final}
    states = {}
    for revision in deployment.revisions.all():
        if revision.pk == deployment.active_revision_id:
            states[revision.label] = "active"
        elif revision.pk in pending:
            states[revision.label] = "rolling out"
        elif revision.pk in switched:
            states[revision.label] = "retired"
        else:
            states[revision.label] = "staged"
    return states


def model_page_row(deployment: ModelDeployment, rollouts: list[FlushJob]) -> dict[str, Any]:
    """``model_row`` plus each revision's state and the deployment's latest rollout job (newest first
    in ``rollouts``, which may hold other deployments' jobs)."""
    mine = [j for j in rollouts if j.deployment_id == deployment.pk]
    states = revision_states(deployment, mine)
    row = model_row(deployment)
    for revision in row["revisions"]:
        revision["state"] = states.get(revision["label"], "staged")
        revision["state_title"] = REVISION_STATES[revision["state"]]
    row["last_rollout"] = job(mine[0]) if mine else None
    return row


def _phase(name: str) -> tuple[str, str]:
    """``cache-worker:m:0:drop:v3`` -> ``("cache-worker:m:0", "drop key v3")`` (a job's result key)."""
    if ":drop:v" in name:
        worker, version = name.split(":drop:v", 1)
        return worker, f"drop key v{version}"
    for suffix in ("stage", "switch", "cancel", "stop"):
        if name.endswith(f":{suffix}"):
            return name[: -len(suffix) - 1], suffix
    return name, "flush"


def tier_result(result: dict) -> dict[str, Any]:
    """One per-worker result for the job page: its phase, blocks freed in L1 / L2, L3 objects
    deleted and bytes freed (flush results carry ``tiers`` and ``l3_bytes``, key drops
    ``objects`` and ``bytes``), and whatever else it said as details."""
    worker, phase = _phase(result["worker"])
    tiers = result.get("tiers") or {}
    l3 = tiers.get("l3", result.get("objects"))
    size = result.get("bytes", result.get("l3_bytes"))
    return {
        "worker": worker, "phase": phase, "status": result.get("status"), "reason": result.get("reason"),
        "blocks_freed": result.get("blocks_freed"), "l1": tiers.get("l1"), "l2": tiers.get("l2"), "l3": l3,
        "l3_bytes": result.get("l3_bytes", result.get("bytes") if "objects" in result else None),
        "bytes": size, "bytes_text": human_bytes(size) if size is not None else "—",
        "details": {k: v for k, v in result.items() if k not in TIER_RESULT_KEYS},
    }


def _total(rows: list[dict], key: str) -> int | None:
    values = [r[key] for r in rows if isinstance(r.get(key), int)]
    return sum(values) if values else None


VERIFY_STEPS = ("verified", "verify_failed", "keys_verified", "keys_verify_failed", "drop_skipped")


def job_page(flush_job: FlushJob) -> dict[str, Any]:
    """``job`` plus per-worker, per-tier results with a totals row, the verification steps and a
    target line that names a shred's key version."""
    view = job(flush_job)
    if view["kind"] == FlushJob.Kind.SHRED and view.get("version"):
        view["target"] = f"{view['target']}, data key v{view['version']}"
    elif view["kind"] == FlushJob.Kind.OFFBOARD:
        view["target"] = f"{view['target']} (offboarding: flush, then shred every data key)"
    rows = [tier_result(r) for r in flush_job_view(flush_job)["results"]]
    view["tier_results"] = rows
    totals = {key: _total(rows, key) for key in ("blocks_freed", "l1", "l2", "l3", "l3_bytes", "bytes")}
    totals["bytes_text"] = human_bytes(totals["bytes"]) if totals["bytes"] is not None else "—"
    view["tier_totals"] = totals
    view["has_tiers"] = any(r[k] is not None for r in rows for k in ("l1", "l2", "l3"))
    view["verification"] = [s for s in view["steps"] if s["step"] in VERIFY_STEPS]
    return view


def operator_token_row(token) -> dict[str, Any]:
    """An operator token for the tokens page: never its hash, only the visible prefix."""
    state = token.state(timezone.now())
    return {"id": token.pk, "username": token.username, "role": token.role, "prefix": token.prefix,
            "created": token.created, "last_used": token.last_used, "revoked_at": token.revoked_at,
            "expires_at": token.expires_at, "state": state, "revoked": state == "revoked",
            "expired": state == "expired"}


def adapter_rows(adapters, *, tenant: Tenant | None = None) -> list[dict[str, Any]]:
    """Adapters as the admin API shows them, each with ``usage``: its last 24 hours in the ledger
    (every tenant's, or ``tenant``'s: requests, prompt tokens, cached tokens by tier), None before a
    request. One ledger query for all of them."""
    rows = [adapter_out(a) for a in adapters]
    sums = model_sums(models=[r["name"] for r in rows], tenant=tenant) if rows else {}
    for row in rows:
        row["usage"] = sums.get(row["name"])
    return rows

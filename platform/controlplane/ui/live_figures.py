"""The dashboard's live figures from ``cluster_stats()``: each tier's capacity split by tenant
(:func:`capacity_bars`, in the tenants' stable chart colours) and the workers' load-versus-recompute
decisions (:func:`decisions`)."""

from __future__ import annotations

from typing import Any

from controlplane.tenants.models import Tenant
from controlplane.ui.chart_spec import REST_COLOR, tenant_color
from controlplane.ui.present import human_bytes
from controlplane.ui.trend_charts import TOP_TENANTS, tier_label


def _pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 1) if whole else 0.0


def capacity_bars(stats: dict) -> list[dict[str, Any]]:
    """Per tier of ``cluster_stats()``: its capacity in bytes split into each tenant's resident bytes
    (the largest :data:`TOP_TENANTS`, the rest together), other used bytes and free bytes."""
    slugs = {t["tenant"] for t in stats.get("tenants", [])}
    ids = dict(Tenant.objects.filter(slug__in=slugs).values_list("slug", "pk")) if slugs else {}
    bars = []
    for name, tier in (stats.get("tiers") or {}).items():
        capacity, used = int(tier.get("capacity_bytes", 0)), int(tier.get("used_bytes", 0))
        owners = sorted(((t["tenant"], int((t.get("resident_bytes") or {}).get(name, 0)))
                         for t in stats.get("tenants", [])), key=lambda kv: (-kv[1], kv[0]))
        owners = [(slug, n) for slug, n in owners if n > 0]
        parts = [(slug, n, tenant_color(slug, ids.get(slug))) for slug, n in owners[:TOP_TENANTS]]
        rest = sum(n for _, n in owners[TOP_TENANTS:])
        if rest:
            parts.append((f"{len(owners) - TOP_TENANTS} other tenants", rest, REST_COLOR))
        unattributed = used - sum(n for _, n, _ in parts)
        if unattributed > 0:
            parts.append(("not attributed", unattributed, "#c9d1d9"))
        segments = [{"label": label, "bytes": human_bytes(n), "pct": _pct(n, capacity), "color": color}
                    for label, n, color in parts]
        bars.append({"name": name, "label": tier_label(name), "capacity": human_bytes(capacity),
                     "used": human_bytes(used), "used_pct": _pct(used, capacity),
                     "free": human_bytes(max(capacity - used, 0)), "segments": segments})
    return bars


def decisions(stats: dict) -> dict[str, Any]:
    """The workers' load-versus-recompute decisions summed (prefixes a lower tier held: loaded when
    that was estimated cheaper than recomputing them), with each worker's policy."""
    load = recompute = 0
    policies = []
    for worker in stats.get("workers", []):
        policy = worker.get("load_policy") or {}
        if worker.get("status") != "ok" or not policy:
            continue
        counts = policy.get("decisions") or {}
        load, recompute = load + int(counts.get("load", 0)), recompute + int(counts.get("recompute", 0))
        policies.append((worker["model"], policy.get("policy", "—")))
    total = load + recompute
    return {"load": load, "recompute": recompute, "total": total, "load_pct": _pct(load, total),
            "recompute_pct": _pct(recompute, total), "policies": policies}

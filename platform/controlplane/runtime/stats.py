"""Gather engine snapshots from every deployment's worker and label tenants by slug.

Workers know tenants only by id (their cache owner key); the slug is attached here. A worker that
does not answer is listed as unreachable; it never fails the whole call.
"""

from __future__ import annotations

from controlplane.common.errors import Unavailable
from controlplane.registry.models import ModelDeployment
from controlplane.runtime import gateway
from controlplane.tenants.models import Tenant


def cluster_stats() -> dict:
    slugs = {str(pk): slug for pk, slug in Tenant.objects.values_list("pk", "slug")}
    workers, totals = [], {"query_tokens": 0, "effective_hit_tokens": 0, "lookup_hit_tokens": 0,
                           "saved_prefill_seconds": 0.0}
    tenants: dict[str, dict] = {}
    for deployment in ModelDeployment.objects.select_related("active_revision").filter(
            active_revision__isnull=False).order_by("name"):
        try:
            snap = gateway.call(gateway.spec_for(deployment), "stats", create=False, timeout=5)
        except Unavailable:
            workers.append({"model": deployment.name, "status": "unreachable"})
            continue
        if snap is None:
            workers.append({"model": deployment.name, "status": "not started"})
            continue
        for row in snap["usage"]:
            row["tenant"] = slugs.get(row["tenant"], row["tenant"])
            agg = tenants.setdefault(row["tenant"], {"tenant": row["tenant"], "query_tokens": 0,
                                                     "effective_hit_tokens": 0, "lookup_hit_tokens": 0,
                                                     "requests": 0, "saved_prefill_seconds": 0.0})
            for key in ("query_tokens", "effective_hit_tokens", "lookup_hit_tokens", "requests",
                        "saved_prefill_seconds"):
                agg[key] += row[key]
        for key in totals:
            totals[key] += snap["totals"][key]
        workers.append({"model": deployment.name, "status": "ok", **snap})
    for agg in tenants.values():
        agg["effective_hit_ratio"] = round(agg["effective_hit_tokens"] / agg["query_tokens"], 4) \
            if agg["query_tokens"] else 0.0
    totals["effective_hit_ratio"] = round(totals["effective_hit_tokens"] / totals["query_tokens"], 4) \
        if totals["query_tokens"] else 0.0
    return {"totals": totals, "tenants": sorted(tenants.values(), key=lambda r: r["tenant"]), "workers": workers}

"""/api/admin/stats: per-tenant and per-tier cache figures gathered from every cache worker."""

from __future__ import annotations

from ninja import Router

from controlplane.adminapi.schemas import StatsOut
from controlplane.runtime import stats

router = Router(tags=["stats"])


@router.get("stats", response=StatsOut)
def get_stats(request):
    return stats.cluster_stats()

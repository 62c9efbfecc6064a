"""The tenant page's "Cache usage" section: the last 24 hours of the tenant cache ledger by hour.

Two charts (``chart_spec.Chart``, drawn by ``ui/_charts.html`` and charts.js): prompt tokens presented, read
from L1 / L2 / L3 and written to the cache; and prompt tokens not reused, by miss reason. The same
figures as a table (the fallback for readers of numbers), the CSV download of the admin API, and the
tenant's live named caches. The ledger is complete (an hour without a row had no usage), so hours
without usage are zeros, not gaps.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.urls import reverse
from django.utils import timezone

from controlplane.caches import residency
from controlplane.caches.residency import Residency
from controlplane.caches.selectors import caches_live
from controlplane.ledger.models import MISS_REASONS, OTHER_REASON, miss_field
from controlplane.ledger.selectors import (
    HOUR,
    LedgerRow,
    ledger_period,
    ledger_rows,
    totals_of,
)
from controlplane.tenants.models import Tenant
from controlplane.ui.chart_spec import TOTAL_COLOR, Chart, Line, position_color, si

WINDOW = timedelta(hours=24)
USAGE = (("presented", "prompt_tokens"), ("read from L1", "cached_l1"), ("read from L2", "cached_l2"),
         ("read from L3", "cached_l3"), ("written", "write_tokens"))
REASON_LABELS = {r: r.replace("_", " ") for r in (*MISS_REASONS, OTHER_REASON)}


def _chart(chart_id: str, title: str, hint: str, lines: list[Line], x: list[float]) -> Chart:
    return Chart(id=chart_id, title=title, hint=hint, x=x, lines=lines, suffix="/h",
                 empty_text="No usage in the last 24 hours.")


def _by_hour(rows: list[LedgerRow], hours: list[datetime]) -> dict[datetime, LedgerRow]:
    out = {h: LedgerRow(tenant_id=None, tenant=None, model=None, hour=h) for h in hours}
    for row in rows:
        if row.hour in out:
            out[row.hour].add(row)
    return out


def _cache_row(cache, where: Residency) -> dict[str, Any]:
    """A named cache's row: ``tiers`` where its tokens are now (``caches.residency``), ``stale`` with
    ``as_of`` when no replica answered in time (its last known figures)."""
    return {"id": cache.public_id, "display_name": cache.display_name, "model": cache.deployment.name,
            "tokens": cache.tokens, "pinned_tokens": cache.pinned_tokens,
            "tiers": " · ".join(f"{name.upper()} {si(n)}" for name, n in sorted(where.tiers.items())) or "—",
            "tiers_stale": where.stale, "tiers_as_of": where.as_of,
            "created": cache.created, "expires_at": cache.expires_at}


def cache_usage(tenant: Tenant, *, now: datetime | None = None) -> dict[str, Any]:
    """The section's context: ``charts``, ``hours`` (table rows, newest first, hours with usage),
    ``totals``, ``reasons`` (the miss reasons charted), ``csv_url`` and ``caches``."""
    now = now or timezone.now()
    start, end = ledger_period(since=now - WINDOW, until=now, now=now)
    hours = [start + k * HOUR for k in range((end - start) // HOUR)]
    rows = ledger_rows(tenant=tenant, since=start, until=end, now=now)
    by_hour = _by_hour(rows, hours)
    totals = totals_of(rows)
    x = [h.timestamp() for h in hours]
    colors = {"prompt_tokens": TOTAL_COLOR, "cached_l1": position_color(0), "cached_l2": position_color(1),
              "cached_l3": position_color(2), "write_tokens": position_color(3)}

    def line(label: str, column: str, color: str) -> Line:
        return Line(label, [float(by_hour[h].counts[column]) for h in hours], color)

    used = any(totals.counts[c] for _, c in USAGE)
    reasons = [r for r in (*MISS_REASONS, OTHER_REASON) if totals.counts[miss_field(r)]]
    every_reason = (*MISS_REASONS, OTHER_REASON)
    slug = tenant.slug
    charts = [
        _chart(f"tenant-{slug}-cache-usage", "Cache usage by hour",
               "prompt tokens per hour: presented, read from each tier, written to the cache",
               [line(label, column, colors[column]) for label, column in USAGE] if used else [], x),
        _chart(f"tenant-{slug}-miss-reasons", "Miss reasons by hour", "prompt tokens not reused per hour, by reason",
               [line(REASON_LABELS[r], miss_field(r), position_color(every_reason.index(r) + 4)) for r in reasons], x),
    ]
    table = [{"hour": h, "requests": r.counts["requests"], "presented": r.counts["prompt_tokens"],
              "l1": r.counts["cached_l1"], "l2": r.counts["cached_l2"], "l3": r.counts["cached_l3"],
              "written": r.counts["write_tokens"],
              "missed": {REASON_LABELS[m]: r.counts[miss_field(m)] for m in reasons if r.counts[miss_field(m)]},
              "pinned_token_hours": r.pinned_token_microseconds / 3.6e9}
             for h, r in sorted(by_hour.items(), reverse=True)
             if r.pinned_token_microseconds or any(v for k, v in r.counts.items() if k != "l3_byte_seconds")]
    caches = list(caches_live(tenant).order_by("-created"))
    now_for = residency.now_for(caches)  # the replicas asked, within residency.ASK_TIMEOUT_S
    query = urlencode({"format": "csv", "since": start.isoformat(), "until": end.isoformat()})
    return {
        "charts": charts, "hours": table, "reasons": [REASON_LABELS[r] for r in reasons],
        "totals": {"requests": totals.counts["requests"], "presented": totals.counts["prompt_tokens"],
                   "cached": totals.counts["cached_tokens"], "written": totals.counts["write_tokens"],
                   "pinned_token_hours": totals.pinned_token_microseconds / 3.6e9},
        "csv_url": f"{reverse('adminapi:tenant_ledger', kwargs={'slug': slug})}?{query}",
        "caches": [_cache_row(c, now_for[c.pk]) for c in caches],
    }

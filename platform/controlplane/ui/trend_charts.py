"""The console's trend charts over the sampled counters: the cluster (:func:`dashboard_charts`) and
one tenant (:func:`tenant_charts`), over a range the operator picks (:data:`RANGES`, up to the 24 h
the sampler keeps).

The series come from ``timeseries.selectors``: per-interval deltas (so a ratio is a ratio of token
deltas and a rate is a delta over the interval's length) put on a fixed grid of buckets ending at
the newest sample (``series_bucketed``: at most about 300 points whatever the range; a bucket with
no sample is a gap). Tenants are drawn in their stable colours; an offboarded tenant keeps its
history, labelled as such and dashed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from controlplane.runtime.stats import tier_names
from controlplane.tenants.models import Tenant
from controlplane.timeseries.config import sampler_config
from controlplane.timeseries.models import RESIDENT_PREFIX
from controlplane.timeseries.selectors import TOTAL, Series, ratio, sample_latest, series_bucketed, series_for
from controlplane.ui.chart_spec import REST_COLOR, TOTAL_COLOR, Chart, Line, position_color, tenant_color
from controlplane.ui.present import TIER_LABELS

RANGES = {"1h": 3600, "6h": 6 * 3600, "24h": 24 * 3600}
DEFAULT_RANGE = "1h"
MAX_POINTS = 300
TOP_TENANTS = 8  # lines per chart; the other tenants are summed into one line
EMPTY_TEXT = ("No samples in this range yet: the sampler records the counters every {interval} s, and a "
              "point needs two samples.")


def range_choice(value: str | None) -> str:
    """A known range name (the default for anything else: a query string is never an error here)."""
    return value if value in RANGES else DEFAULT_RANGE


@dataclass(frozen=True)
class Window:
    """One range's series on its grid, and the helpers that turn a scope into chart values."""

    series: Series
    range: str
    step: float  # seconds per point

    @property
    def x(self) -> list[float]:
        return [t.timestamp() for t in self.series.times]

    def values(self, scope: Sequence[dict | None], fn: Callable[[dict | None, float], float | None]
               ) -> list[float | None]:
        return [None if v is None else fn(v, s) for s, v in zip(self.series.seconds, scope, strict=True)]

    def summed(self, kind: str, names: Sequence[str]) -> list[dict | None]:
        """Point by point, the sum of ``names``' deltas (None where none of them reported)."""
        out: list[dict | None] = []
        for k in range(len(self.series.times)):
            parts = [v for v in (self.series.scope(kind, n)[k] for n in names) if v is not None]
            total: dict | None = {} if parts else None
            for part in parts:
                for key, value in part.items():
                    total[key] = total.get(key, 0) + value
            out.append(total)
        return out


def window_step(range_name: str) -> int:
    """Seconds per point: the sample interval, or a multiple of it keeping :data:`MAX_POINTS`."""
    interval = sampler_config().interval_seconds
    return max(interval, math.ceil(RANGES[range_name] / MAX_POINTS / interval) * interval)


def window(range_name: str, tenant: str | None = None, *, end: datetime | None = None) -> Window:
    """The range's grid ending at the newest sample (or now, before the first one)."""
    interval = sampler_config().interval_seconds
    step = window_step(range_name)
    count = max(1, RANGES[range_name] // step)
    end = end or sample_latest() or timezone.now()
    start = end - timedelta(seconds=count * step)
    raw = series_for(since=start - timedelta(seconds=interval), tenant=tenant)  # + the first baseline
    grid = series_bucketed(raw, start=start, width=step, count=count, max_seconds=2.5 * interval)
    return Window(series=grid, range=range_name, step=step)


def _chart(w: Window, chart_id: str, title: str, hint: str, lines: list[Line], **options) -> Chart:
    empty = EMPTY_TEXT.format(interval=sampler_config().interval_seconds)
    return Chart(id=chart_id, title=title, hint=hint, x=w.x, lines=lines, empty_text=empty, **options)


def _per(key: str, per: float = 1.0) -> Callable[[dict | None, float], float | None]:
    return lambda v, s: None if v is None or s <= 0 else v.get(key, 0) * per / s


def _hit_ratio(key: str = "effective_hit_tokens") -> Callable[[dict | None, float], float | None]:
    return lambda v, _s: ratio(v, key)


def _tenants(w: Window) -> tuple[list[str], list[str]]:
    """The :data:`TOP_TENANTS` tenants with the most prompt tokens in the range, and the rest."""
    def tokens(slug: str) -> float:
        return sum(v.get("query_tokens", 0) for v in w.series.scope("tenant", slug) if v)

    ranked = sorted(w.series.names("tenant"), key=lambda s: (-tokens(s), s))
    return ranked[:TOP_TENANTS], ranked[TOP_TENANTS:]


def tenant_lines(w: Window, fn) -> list[Line]:
    """One line per top tenant in its colour (offboarded: labelled, dashed), then the rest summed."""
    top, rest = _tenants(w)
    rows = {slug: (pk, status) for slug, pk, status in
            Tenant.objects.filter(slug__in=top).values_list("slug", "pk", "status")}
    lines = []
    for slug in top:
        pk, status = rows.get(slug, (None, None))
        gone = status == Tenant.Status.OFFBOARDED or pk is None
        label = f"{slug} (offboarded)" if status == Tenant.Status.OFFBOARDED else slug if pk else f"{slug} (removed)"
        lines.append(Line(label, w.values(w.series.scope("tenant", slug), fn), tenant_color(slug, pk), dashed=gone))
    if rest:
        lines.append(Line(f"{len(rest)} other tenants", w.values(w.summed("tenant", rest), fn), REST_COLOR))
    return lines


def tier_label(name: str) -> str:
    return f"{name.upper()} {TIER_LABELS.get(name, '')}".strip()


def _tier_lines(w: Window, fn) -> list[Line]:
    return [Line(tier_label(n), w.values(w.series.scope("tier", n), fn), position_color(i))
            for i, n in enumerate(tier_names(w.series.names("tier")))]


def _use(v: dict | None, _s: float) -> float | None:
    return ratio(v, "used_bytes", "capacity_bytes")


def _traffic(w: Window, scope: Sequence[dict | None], prefix: str) -> list[Chart]:
    """Prefill time saved, requests and prompt tokens per second, for one scope's deltas."""
    return [
        _chart(w, f"{prefix}-saved", "Prefill time saved", "seconds of prefill skipped per minute",
               [Line("saved", w.values(scope, _per("saved_prefill_seconds", 60)), position_color(2))],
               unit="seconds", suffix="/min"),
        _chart(w, f"{prefix}-requests", "Requests", "per second",
               [Line("requests", w.values(scope, _per("requests")), position_color(0))], suffix="/s"),
        _chart(w, f"{prefix}-tokens", "Prompt tokens", "per second: presented to the cache and prefill skipped",
               [Line("presented", w.values(scope, _per("query_tokens")), position_color(0)),
                Line("prefill skipped", w.values(scope, _per("effective_hit_tokens")), position_color(2))],
               suffix="/s"),
    ]


def dashboard_charts(range_name: str = DEFAULT_RANGE) -> list[Chart]:
    """The cluster's charts over the range."""
    w = window(range_name)
    total = w.series.scope(TOTAL)
    hit = [Line("all tenants", w.values(total, _hit_ratio()), TOTAL_COLOR), *tenant_lines(w, _hit_ratio())]
    return [
        _chart(w, "chart-hit-ratio", "Effective hit ratio by tenant",
               "prompt tokens whose prefill was skipped ÷ prompt tokens presented, per point",
               hit, unit="percent", y_max=1.0),
        *_traffic(w, total, "chart"),
        _chart(w, "chart-tier-use", "Tier use", "share of each tier's capacity in use",
               _tier_lines(w, _use), unit="percent", y_max=1.0),
        _chart(w, "chart-tier-hits", "Tier hits", "prompt tokens loaded from each tier per second",
               _tier_lines(w, _per("hit_tokens")), suffix="/s"),
        _chart(w, "chart-evictions", "Evictions", "blocks evicted from each tier per minute",
               _tier_lines(w, _per("evictions", 60)), suffix="/min"),
        _chart(w, "chart-decisions", "Load or recompute", "prefixes found in a lower tier, per minute",
               [Line("loaded", w.values(total, _per("decisions_load", 60)), position_color(0)),
                Line("recomputed", w.values(total, _per("decisions_recompute", 60)), position_color(1))],
               suffix="/min"),
    ]


def tenant_charts(slug: str, range_name: str = DEFAULT_RANGE) -> list[Chart]:
    """The same charts for one tenant: its hit-ratio layers, traffic and resident bytes per tier."""
    w = window(range_name, tenant=slug)
    scope = w.series.scope("tenant", slug)
    tiers = {k.removeprefix(RESIDENT_PREFIX) for v in scope if v for k in v if k.startswith(RESIDENT_PREFIX)}
    resident = [Line(tier_label(t), w.values(scope, lambda v, _s, t=t: v.get(RESIDENT_PREFIX + t, 0)),
                     position_color(i)) for i, t in enumerate(tier_names(tiers))]
    layers = [("prefill skipped", "effective_hit_tokens"), ("bytes arrived", "load_success_tokens"),
              ("index held", "lookup_hit_tokens")]
    return [
        _chart(w, f"tenant-{slug}-hit-ratio", "Hit ratio",
               "token-weighted per point: prefill skipped, bytes arrived, index held",
               [Line(label, w.values(scope, _hit_ratio(key)), position_color(i))
                for i, (label, key) in enumerate(layers)], unit="percent", y_max=1.0),
        *_traffic(w, scope, f"tenant-{slug}"),
        _chart(w, f"tenant-{slug}-resident", "Resident bytes", "this tenant's cached bytes in each tier",
               resident, unit="bytes"),
    ]

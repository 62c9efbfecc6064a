"""Charts over the last hour of samples, rendered as SVG on the server (no JavaScript, no library).

:func:`line_chart` draws lines with axes, ticks and a legend; every label is escaped. The chart
builders read ``timeseries.selectors.series_for`` (per-interval deltas, so a ratio is a ratio of
token deltas and a rate is a delta over the interval's length). :func:`dashboard_charts` is the
cluster view, :func:`tenant_charts` the same for one tenant; both return chart contexts that
``ui/_charts.html`` renders. :func:`capacity_bars` and :func:`decisions` are the dashboard's live
figures of the current tier use (by tenant) and of the load-versus-recompute choices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from html import escape
from typing import Any

from django.utils import timezone
from django.utils.safestring import SafeString, mark_safe

from controlplane.runtime.stats import tier_names
from controlplane.timeseries.config import sampler_config
from controlplane.timeseries.models import RESIDENT_PREFIX
from controlplane.timeseries.selectors import TOTAL, Series, ratio, sample_latest, series_for
from controlplane.ui.present import TIER_LABELS, human_bytes

WINDOW = timedelta(hours=1)
TOP_TENANTS = 8  # lines per chart; the other tenants are summed into one line
PALETTE = ("#1f5fbf", "#e07b00", "#1e7b45", "#b42318", "#7a4fbf", "#0f8b8d", "#c2185b", "#8a5a00",
           "#4b5563", "#2f855a")
TIME_STEPS = (10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
EMPTY_TEXT = "No samples in this window yet"

Point = tuple[float, float | None]


# ---------------------------------------------------------------------- SVG line charts
@dataclass(frozen=True)
class Line:
    """One series: ``(x, y)`` points in x order; ``y=None`` breaks the line (no data there)."""

    label: str
    points: Sequence[Point]


def nice_step(span: float, target: int) -> float:
    """A 1-2-2.5-5 x 10^n step that cuts ``span`` into at most about ``target`` parts."""
    raw = span / max(target, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 2.5, 5, 10):
        if mult * magnitude >= raw * (1 - 1e-9):
            return mult * magnitude
    return 10 * magnitude


def value_ticks(lo: float, hi: float, target: int = 4) -> list[float]:
    """Ticks from ``lo`` (rounded down) to ``hi`` (rounded up) at a nice step; the first and last are
    the axis's ends."""
    if not hi > lo:
        hi = lo + (abs(lo) or 1.0)
    step = nice_step(hi - lo, target)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 10) for k in range(first, last + 1)]


def time_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Epoch seconds inside [lo, hi] at a round step (10 s ... 1 day) giving at most ``target`` ticks."""
    span = max(hi - lo, 1.0)
    step = next((s for s in TIME_STEPS if span / s <= target), TIME_STEPS[-1])
    first = math.ceil(lo / step) * step
    return [float(t) for t in range(int(first), int(hi) + 1, step)]


def _fmt(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _runs(points: Sequence[tuple[float, float] | None]) -> list[list[tuple[float, float]]]:
    runs: list[list[tuple[float, float]]] = [[]]
    for point in points:
        if point is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(point)
    return [run for run in runs if run]


def line_chart(lines: Sequence[Line], *, x_range: tuple[float, float], y_range: tuple[float, float] | None = None,
               y_format: Callable[[float], str] = _fmt, x_format: Callable[[float], str] = _fmt,
               y_unit: float = 1.0, label: str = "", width: int = 560, height: int = 200) -> SafeString:
    """An SVG line chart of ``lines`` over ``x_range`` (points outside it are dropped). The y axis is
    ``y_range`` when given, else 0 (or the lowest value, if negative) to the highest value, rounded
    to nice ticks in multiples of ``y_unit`` (e.g. 1024 ** n for bytes). Returns markup safe to
    insert (all text escaped); lines without points give the axes and the text :data:`EMPTY_TEXT`."""
    left, right, top = 62, width - 12, 10
    bottom = height - 24
    x0, x1 = x_range
    kept = [[(x, y) for x, y in line.points if x0 <= x <= x1] for line in lines]
    values = [y for points in kept for _, y in points if y is not None]
    lo, hi = y_range if y_range is not None else (min([0.0, *values]), max([0.0, *values]))
    ticks = [t * y_unit for t in value_ticks(lo / y_unit, hi / y_unit)]
    y0, y1 = ticks[0], ticks[-1]

    def sx(x: float) -> float:
        return left + (right - left) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def sy(y: float) -> float:
        y = min(max(y, y0), y1)
        return bottom - (bottom - top) * (y - y0) / (y1 - y0)

    # Legend rows under the plot: items wrap at the chart's width (about 6.5 px a character).
    legend, lx, ly = [], left, height + 4
    for i, line in enumerate(lines):
        item = 18 + int(6.5 * len(line.label)) + 14
        if lx + item > right and lx > left:
            lx, ly = left, ly + 16
        legend.append((lx, ly, PALETTE[i % len(PALETTE)], line.label))
        lx += item
    total_height = (ly + 18) if lines else height

    title = escape(label)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart-svg" viewBox="0 0 {width} {total_height}" '
           f'role="img" aria-label="{title}"><title>{title}</title>',
           '<g class="chart-grid" stroke="#dde2e8" stroke-width="1">']
    out += [f'<line x1="{left}" x2="{right}" y1="{_fmt(sy(t))}" y2="{_fmt(sy(t))}"/>' for t in ticks]
    out.append("</g>")
    out.append('<g class="chart-axis" font-size="11" fill="#5b6675">')
    out += [f'<text x="{left - 6}" y="{_fmt(sy(t) + 4)}" text-anchor="end">{escape(y_format(t))}</text>'
            for t in ticks]
    out.append(f'<line x1="{left}" x2="{right}" y1="{bottom}" y2="{bottom}" stroke="#5b6675"/>')
    for t in time_ticks(x0, x1) if x1 > x0 else [x0]:
        x = _fmt(sx(t))
        out.append(f'<line x1="{x}" x2="{x}" y1="{bottom}" y2="{bottom + 4}" stroke="#5b6675"/>'
                   f'<text x="{x}" y="{bottom + 16}" text-anchor="middle">{escape(x_format(t))}</text>')
    out.append("</g>")
    if not values:
        out.append(f'<text class="chart-empty" x="{_fmt((left + right) / 2)}" y="{_fmt((top + bottom) / 2)}" '
                   f'text-anchor="middle" font-size="13" fill="#5b6675">{EMPTY_TEXT}</text>')
    out.append('<g class="chart-lines" fill="none" stroke-width="2" stroke-linejoin="round">')
    for i, (line, points) in enumerate(zip(lines, kept, strict=True)):
        color, name = PALETTE[i % len(PALETTE)], escape(line.label)
        for run in _runs([(x, y) if y is not None else None for x, y in points]):
            if len(run) == 1:  # a lone point has no segment to draw: mark it
                x, y = run[0]
                out.append(f'<circle data-series="{name}" cx="{_fmt(sx(x))}" cy="{_fmt(sy(y))}" r="2.5" '
                           f'fill="{color}"/>')
            else:
                coords = " ".join(f"{_fmt(sx(x))},{_fmt(sy(y))}" for x, y in run)
                out.append(f'<polyline data-series="{name}" stroke="{color}" points="{coords}"/>')
    out.append("</g>")
    out.append('<g class="chart-legend" font-size="11" fill="#1c2430">')
    for x, y, color, text in legend:
        out.append(f'<rect x="{x}" y="{y}" width="10" height="10" rx="2" fill="{color}"/>'
                   f'<text x="{x + 14}" y="{y + 9}">{escape(text)}</text>')
    out.append("</g></svg>")
    return mark_safe("".join(out))  # noqa: S308 - every interpolated text above is escaped


# ---------------------------------------------------------------------- value formats
def si(value: float) -> str:
    """12_300 -> '12.3k' (k, M, G); small values keep up to two decimals."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}" if value else "0"


def byte_unit(values) -> float:
    """The largest power of 1024 not above the largest of ``values`` (1 for none): a bytes axis's unit."""
    top = max([0, *values])
    return float(1024 ** max(0, min(4, int(math.log(top, 1024))))) if top >= 1 else 1.0


def percent(value: float) -> str:
    return f"{100 * value:.0f}%"


def clock(epoch: float) -> str:
    return timezone.localtime(datetime.fromtimestamp(epoch, tz=timezone.get_current_timezone())).strftime("%H:%M")


# ---------------------------------------------------------------------- chart contexts
def _per(values: dict | None, key: str, seconds: float, per: float = 1.0) -> float | None:
    if values is None or seconds <= 0:
        return None
    return values.get(key, 0) * per / seconds


class _Window:
    """A window's series plus the helpers that turn one scope into points."""

    def __init__(self, series: Series, end: datetime | None) -> None:
        self.series = series
        self.end = end

    @property
    def x_range(self) -> tuple[float, float]:
        end = (self.end or timezone.now()).timestamp()
        return end - WINDOW.total_seconds(), end

    def points(self, scope: Sequence[dict | None], fn: Callable[[dict | None, float], float | None]) -> list[Point]:
        return [(t.timestamp(), fn(v, s)) for t, s, v in zip(self.series.times, self.series.seconds, scope,
                                                               strict=True)]

    def summed(self, kind: str, names: Sequence[str]) -> list[dict | None]:
        """Interval by interval, the sum of ``names``' deltas (None where none of them reported)."""
        out: list[dict | None] = []
        for k in range(len(self.series.times)):
            parts = [v for v in (self.series.scope(kind, n)[k] for n in names) if v is not None]
            total: dict | None = {} if parts else None
            for part in parts:
                for key, value in part.items():
                    total[key] = total.get(key, 0) + value
            out.append(total)
        return out


def _window(tenant: str | None = None) -> _Window:
    end = sample_latest()
    if end is None:
        return _Window(Series(times=(), seconds=(), scopes={}), None)
    since = end - WINDOW - timedelta(seconds=sampler_config().interval_seconds)  # + the first interval's baseline
    return _Window(series_for(since=since, tenant=tenant), end)


def _chart(window: _Window, chart_id: str, title: str, hint: str, lines: list[Line], *,
           y_format: Callable[[float], str] = si, y_range: tuple[float, float] | None = None,
           latest_format: Callable[[float], str] | None = None, y_unit: float = 1.0) -> dict[str, Any]:
    """A chart context for ``ui/_charts.html``: id, title, hint, the SVG, ``empty`` and each line's
    latest value (the text beside the chart, for readers of numbers)."""
    fmt = latest_format or y_format
    latest = []
    for line in lines:
        last = next((y for _, y in reversed(line.points) if y is not None), None)
        latest.append((line.label, "—" if last is None else fmt(last)))
    svg = line_chart(lines, x_range=window.x_range, y_range=y_range, y_format=y_format, x_format=clock,
                     y_unit=y_unit, label=f"{title} ({hint})")
    empty = not any(y is not None for line in lines for _, y in line.points)
    return {"id": chart_id, "title": title, "hint": hint, "svg": svg, "empty": empty, "latest": latest}


def _top_tenants(window: _Window) -> tuple[list[str], list[str]]:
    """The :data:`TOP_TENANTS` tenants with the most prompt tokens in the window, and the rest."""
    def tokens(slug: str) -> float:
        return sum(v.get("query_tokens", 0) for v in window.series.scope("tenant", slug) if v)

    ranked = sorted(window.series.names("tenant"), key=lambda s: (-tokens(s), s))
    return ranked[:TOP_TENANTS], ranked[TOP_TENANTS:]


def _hit_ratio(v: dict | None, _s: float, key: str = "effective_hit_tokens") -> float | None:
    return ratio(v, key)


def _tenant_lines(window: _Window, fn) -> list[Line]:
    top, rest = _top_tenants(window)
    lines = [Line(slug, window.points(window.series.scope("tenant", slug), fn)) for slug in top]
    if rest:
        lines.append(Line(f"{len(rest)} other tenants", window.points(window.summed("tenant", rest), fn)))
    return lines


def _tier_label(name: str) -> str:
    return f"{name.upper()} {TIER_LABELS.get(name, '')}".strip()


def _tier_lines(window: _Window, fn) -> list[Line]:
    return [Line(_tier_label(n), window.points(window.series.scope("tier", n), fn))
            for n in tier_names(window.series.names("tier"))]


def _use(v: dict | None, _s: float) -> float | None:
    return ratio(v, "used_bytes", "capacity_bytes")


def _traffic_charts(window: _Window, scope: Sequence[dict | None], prefix: str) -> list[dict[str, Any]]:
    """Requests and prompt tokens per second and prefill time saved, for one scope's deltas."""
    return [
        _chart(window, f"{prefix}-saved", "Prefill time saved", "seconds of prefill skipped per minute",
               [Line("saved", window.points(scope, lambda v, s: _per(v, "saved_prefill_seconds", s, 60)))],
               latest_format=lambda x: f"{x:.2f} s/min"),
        _chart(window, f"{prefix}-requests", "Requests", "per second",
               [Line("requests", window.points(scope, lambda v, s: _per(v, "requests", s)))],
               latest_format=lambda x: f"{si(x)}/s"),
        _chart(window, f"{prefix}-tokens", "Prompt tokens", "per second: presented to the cache and prefill skipped",
               [Line("presented", window.points(scope, lambda v, s: _per(v, "query_tokens", s))),
                Line("prefill skipped", window.points(scope, lambda v, s: _per(v, "effective_hit_tokens", s)))],
               latest_format=lambda x: f"{si(x)}/s"),
    ]


def dashboard_charts() -> list[dict[str, Any]]:
    """The cluster's charts over the last hour of samples."""
    window = _window()
    total = window.series.scope(TOTAL)
    hit = [Line("all tenants", window.points(total, _hit_ratio)), *_tenant_lines(window, _hit_ratio)]
    return [
        _chart(window, "chart-hit-ratio", "Effective hit ratio by tenant",
               "prompt tokens whose prefill was skipped ÷ prompt tokens presented, per interval",
               hit, y_format=percent, y_range=(0.0, 1.0), latest_format=lambda x: f"{100 * x:.1f}%"),
        *_traffic_charts(window, total, "chart"),
        _chart(window, "chart-tier-use", "Tier use", "share of each tier's capacity in use",
               _tier_lines(window, _use), y_format=percent, y_range=(0.0, 1.0),
               latest_format=lambda x: f"{100 * x:.1f}%"),
        _chart(window, "chart-tier-hits", "Tier hits", "prompt tokens loaded from each tier per second",
               _tier_lines(window, lambda v, s: _per(v, "hit_tokens", s)), latest_format=lambda x: f"{si(x)}/s"),
        _chart(window, "chart-evictions", "Evictions", "blocks evicted from each tier per minute",
               _tier_lines(window, lambda v, s: _per(v, "evictions", s, 60)),
               latest_format=lambda x: f"{si(x)}/min"),
        _chart(window, "chart-decisions", "Load or recompute", "prefixes found in a lower tier, per minute",
               [Line("loaded", window.points(total, lambda v, s: _per(v, "decisions_load", s, 60))),
                Line("recomputed", window.points(total, lambda v, s: _per(v, "decisions_recompute", s, 60)))],
               latest_format=lambda x: f"{si(x)}/min"),
    ]


def tenant_charts(slug: str) -> list[dict[str, Any]]:
    """The same charts for one tenant (its hit-ratio layers, traffic and resident bytes per tier)."""
    window = _window(tenant=slug)
    scope = window.series.scope("tenant", slug)
    tiers = {k.removeprefix(RESIDENT_PREFIX) for v in scope if v for k in v if k.startswith(RESIDENT_PREFIX)}
    resident = [Line(_tier_label(t), window.points(scope, lambda v, s, t=t: None if v is None
                                                   else v.get(RESIDENT_PREFIX + t, 0)))
                for t in tier_names(tiers)]
    layers = [("prefill skipped", "effective_hit_tokens"), ("bytes arrived", "load_success_tokens"),
              ("index held", "lookup_hit_tokens")]
    return [
        _chart(window, f"tenant-{slug}-hit-ratio", "Hit ratio",
               "token-weighted per interval: prefill skipped, bytes arrived, index held",
               [Line(label, window.points(scope, lambda v, s, key=key: _hit_ratio(v, s, key)))
                for label, key in layers],
               y_format=percent, y_range=(0.0, 1.0), latest_format=lambda x: f"{100 * x:.1f}%"),
        *_traffic_charts(window, scope, f"tenant-{slug}"),
        _chart(window, f"tenant-{slug}-resident", "Resident bytes", "this tenant's cached bytes in each tier",
               resident, y_format=human_bytes, y_unit=byte_unit(y for line in resident for _, y in line.points if y)),
    ]


# ---------------------------------------------------------------------- live figures
def _pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 1) if whole else 0.0


def capacity_bars(stats: dict) -> list[dict[str, Any]]:
    """Per tier of ``cluster_stats()``: its capacity in bytes split into each tenant's resident bytes
    (the largest :data:`TOP_TENANTS`, the rest together), other used bytes and free bytes."""
    bars = []
    for name, tier in (stats.get("tiers") or {}).items():
        capacity, used = int(tier.get("capacity_bytes", 0)), int(tier.get("used_bytes", 0))
        owners = sorted(((t["tenant"], int((t.get("resident_bytes") or {}).get(name, 0)))
                         for t in stats.get("tenants", [])), key=lambda kv: (-kv[1], kv[0]))
        owners = [(slug, n) for slug, n in owners if n > 0]
        parts = [(slug, n, PALETTE[i % len(PALETTE)]) for i, (slug, n) in enumerate(owners[:TOP_TENANTS])]
        rest = sum(n for _, n in owners[TOP_TENANTS:])
        if rest:
            parts.append((f"{len(owners) - TOP_TENANTS} other tenants", rest, PALETTE[TOP_TENANTS % len(PALETTE)]))
        unattributed = used - sum(n for _, n, _ in parts)
        if unattributed > 0:
            parts.append(("not attributed", unattributed, "#9aa5b1"))
        segments = [{"label": label, "bytes": human_bytes(n), "pct": _pct(n, capacity), "color": color}
                    for label, n, color in parts]
        bars.append({"name": name, "label": _tier_label(name), "capacity": human_bytes(capacity),
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


def dashboard_context(stats: dict) -> dict[str, Any]:
    """What the dashboard adds to ``present.dashboard(stats)``: charts, capacity bars, decisions."""
    return {"charts": dashboard_charts(), "capacity": capacity_bars(stats), "decisions": decisions(stats),
            "sample_seconds": sampler_config().interval_seconds}

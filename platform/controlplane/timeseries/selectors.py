"""Per-interval deltas of the sampled counters, for charts.

A worker's counters are cumulative since it started, so what happened between two consecutive
samples is the difference of their values. Deltas are taken per worker (the row's ``model`` and
``replica``) and then summed per scope; the ``total`` scope is the sum of the ``model`` scopes. Ratios over an
interval are ratios of these deltas (``ratio``), never of request counts.

Counter resets: a worker that restarted (or rolled out a new engine) starts again from zero. When
any counter of a worker's ``model`` row went down, every row of that worker is reset at that
sample, and a row whose own counter went down is reset too: the delta is then the new value (what
was counted since the restart). A scope that first shows while its worker was already being sampled
(a tenant's first request) counts from zero; the first sample of a worker in the window is only a
baseline. Gauges (``models.is_gauge``: capacity and use) are the level at the interval's end.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Max, Q

from controlplane.timeseries.models import StatSample, is_gauge

TOTAL = "total"  # the cluster-wide scope: kind "total", name ""

Values = dict[str, Any]


@dataclass(frozen=True)
class Series:
    """``times[k]`` ends interval ``k``, which lasted ``seconds[k]``; ``scopes[(kind, name)][k]`` holds
    the counters' deltas over it summed over workers (gauges: their levels), or None where no worker
    reported that scope in both of the interval's samples."""

    times: tuple[datetime, ...]
    seconds: tuple[float, ...]
    scopes: dict[tuple[str, str], tuple[Values | None, ...]]

    def scope(self, kind: str, name: str = "") -> tuple[Values | None, ...]:
        return self.scopes.get((kind, name), (None,) * len(self.times))

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self.scopes if k == kind)


def ratio(values: Values | None, part: str, whole: str = "query_tokens") -> float | None:
    """``values[part] / values[whole]`` (token-weighted over the interval); None without tokens."""
    if not values or not values.get(whole):
        return None
    return values.get(part, 0) / values[whole]


def _decreased(before: Values, after: Values) -> bool:
    return any(after.get(k, 0) < v for k, v in before.items() if not is_gauge(k))


def _delta(before: Values, after: Values) -> Values:
    return {k: v if is_gauge(k) else v - before.get(k, 0) for k, v in after.items()}


def _add(into: Values, values: Values) -> None:
    for key, value in values.items():
        into[key] = into.get(key, 0) + value


def series_from_rows(rows: Iterable[tuple]) -> Series:
    """:class:`Series` from ``(at, kind, name, model, values)`` or ``(at, kind, name, model, replica,
    values)`` rows (any order; without a replica a row is replica 0's)."""
    rows = [row if len(row) == 6 else (*row[:4], 0, row[4]) for row in rows]
    times = sorted({row[0] for row in rows})
    index = {t: i for i, t in enumerate(times)}
    samples: dict[tuple[str, str, tuple[str, int]], dict[int, Values]] = defaultdict(dict)
    for at, kind, name, model, replica, values in rows:
        samples[(kind, name, (model, replica))][index[at]] = values

    # A worker is one replica of a deployment: (model, replica).
    seen: dict[tuple[str, int], list[int]] = {}  # worker -> sample indices at which it answered
    resets: dict[tuple[str, int], list[int]] = {}  # worker -> sample indices at which it had restarted
    for (kind, name, worker), by_index in samples.items():
        if kind == StatSample.Kind.MODEL and name == worker[0]:
            order = sorted(by_index)
            seen[worker] = order
            resets[worker] = [i for j, i in zip(order, order[1:], strict=False)
                              if _decreased(by_index[j], by_index[i])]

    out: dict[tuple[str, str], list[Values | None]] = defaultdict(lambda: [None] * (len(times) - 1))
    for (kind, name, worker), by_index in samples.items():
        worker_seen, worker_resets = seen.get(worker, []), resets.get(worker, [])
        before: int | None = None
        for i in sorted(by_index):
            current = by_index[i]
            if before is None:
                # New in the window: from zero if its worker was sampled earlier, else a baseline.
                base = {} if worker_seen and worker_seen[0] < i else None
            else:
                restarted = bisect.bisect_right(worker_resets, before) < bisect.bisect_right(worker_resets, i)
                previous = by_index[before]
                base = {} if restarted or _decreased(previous, current) else previous
            before = i
            if base is None:
                continue
            delta = _delta(base, current)
            for scope in [(kind, name)] + ([(TOTAL, "")] if kind == StatSample.Kind.MODEL else []):
                slot = out[scope]
                if slot[i - 1] is None:
                    slot[i - 1] = {}
                _add(slot[i - 1], delta)

    seconds = tuple((b - a).total_seconds() for a, b in zip(times, times[1:], strict=False))
    return Series(times=tuple(times[1:]), seconds=seconds, scopes={k: tuple(v) for k, v in out.items()})


def series_for(*, since: datetime, tenant: str | None = None) -> Series:
    """Deltas of every scope sampled at or after ``since``; with ``tenant`` (a slug) only that tenant's
    scope plus the ``model`` and ``total`` scopes (whose rows tell worker restarts apart)."""
    rows = StatSample.objects.filter(at__gte=since)
    if tenant is not None:
        rows = rows.filter(Q(kind=StatSample.Kind.TENANT, name=tenant) | Q(kind=StatSample.Kind.MODEL))
    return series_from_rows(rows.values_list("at", "kind", "name", "model", "replica", "values"))


def sample_latest() -> datetime | None:
    """The time of the newest sample, None before the first."""
    return StatSample.objects.aggregate(latest=Max("at"))["latest"]


def series_bucketed(series: Series, *, start: datetime, width: float, count: int,
                    max_seconds: float | None = None) -> Series:
    """``series`` on a fixed grid of ``count`` buckets of ``width`` seconds after ``start``.

    Bucket ``k`` covers ``(start + k*width, start + (k+1)*width]`` and sums the deltas (gauges: the
    last level) and the seconds of the intervals that end inside it. A bucket in which no interval
    ends is None for every scope: a gap (the sampler was not running), never a zero. An interval
    longer than ``max_seconds`` (it spans a time the sampler was down) is left out, so that a stop
    shows as a gap rather than as one averaged point."""
    t0 = start.timestamp()
    slots: list[list[int]] = [[] for _ in range(count)]
    seconds = [0.0] * count
    for i, (at, length) in enumerate(zip(series.times, series.seconds, strict=True)):
        if max_seconds is not None and length > max_seconds:
            continue
        k = math.ceil((at.timestamp() - t0) / width - 1e-9) - 1
        if 0 <= k < count:
            slots[k].append(i)
            seconds[k] += length
    scopes: dict[tuple[str, str], tuple[Values | None, ...]] = {}
    for key, values in series.scopes.items():
        out: list[Values | None] = []
        for members in slots:
            parts = [values[i] for i in members if values[i] is not None]
            total: Values | None = {} if parts else None
            for part in parts:
                for name, value in part.items():
                    total[name] = value if is_gauge(name) else total.get(name, 0) + value
            out.append(total)
        scopes[key] = tuple(out)
    times = tuple(start + timedelta(seconds=width * (k + 1)) for k in range(count))
    return Series(times=times, seconds=tuple(seconds), scopes=scopes)

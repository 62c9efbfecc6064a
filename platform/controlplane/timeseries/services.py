"""Take a sample of every running worker's counters (``runtime.stats.cluster_stats(refresh=True)``:
every replica polled now, on the sample store's threads) and prune samples older than the retention.

A sample's time is floored to the interval, and rows are inserted ignoring conflicts on (time,
scope, worker replica): a second sampler writing the same interval (two web processes) adds nothing.
Workers that do not answer contribute no rows; their counters are picked up again at the next
sample they answer (the delta then spans the gap).

The same transaction accrues the sample's L3 storage into the tenant cache ledger, when that app is
installed (``ledger.services.ledger_accrue_sample``: bytes x interval, once per sample time).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from django.db import transaction
from django.utils import timezone

from controlplane.runtime.stats import TIER_OPTIONAL_SUMS, TIER_SUMS, USAGE_FLOAT_SUMS, USAGE_SUMS, cluster_stats
from controlplane.timeseries.config import sampler_config
from controlplane.timeseries.models import RESIDENT_PREFIX, StatSample

USAGE_OPTIONAL = ("prefill_tokens", "hit_requests")  # recorded where the worker reports them
TIER_KEYS = (*TIER_SUMS, *TIER_OPTIONAL_SUMS)


class SampleResult(NamedTuple):
    at: datetime
    written: int  # rows offered (a duplicate interval's rows are ignored by the database)
    pruned: int


def sample_time(now: datetime, interval_seconds: int) -> datetime:
    """``now`` floored to a multiple of the interval since the epoch (every sampler agrees)."""
    epoch = int(now.timestamp())
    return datetime.fromtimestamp(epoch - epoch % interval_seconds, tz=now.tzinfo or UTC)


def _pick(row: dict, keys, optional=()) -> dict[str, Any]:
    out = {k: row.get(k, 0) for k in keys}
    out.update({k: row[k] for k in optional if k in row})
    return out


def _add(into: dict[str, Any], row: dict[str, Any]) -> None:
    for key, value in row.items():
        into[key] = into.get(key, 0) + value


def worker_rows(worker: dict) -> list[tuple[str, str, dict[str, Any]]]:
    """``(kind, name, values)`` of one running worker as ``cluster_stats()["workers"]`` lists it
    (usage rows already labelled by slug, tiers with bytes, resident bytes per tier and slug)."""
    counters = (*USAGE_SUMS, *USAGE_FLOAT_SUMS)
    totals = _pick(worker.get("totals") or {}, counters, USAGE_OPTIONAL)
    decisions = (worker.get("load_policy") or {}).get("decisions") or {}
    totals.update(evictions=worker.get("evictions", 0), decisions_load=decisions.get("load", 0),
                  decisions_recompute=decisions.get("recompute", 0))
    rows = [(StatSample.Kind.MODEL, worker["model"], totals)]

    tenants: dict[str, dict[str, Any]] = {}
    for usage in worker.get("usage") or []:
        values = _pick(usage, counters, USAGE_OPTIONAL)
        histogram = usage.get("hit_histogram") or []
        if histogram and "hit_requests" not in values:  # bucket 0 = requests with no prefill skipped
            values["hit_requests"] = usage.get("requests", 0) - histogram[0]
        _add(tenants.setdefault(str(usage["tenant"]), {}), values)
    for tier, owners in (worker.get("resident_bytes") or {}).items():
        for slug, nbytes in owners.items():
            tenants.setdefault(slug, {})[RESIDENT_PREFIX + tier] = nbytes
    rows += [(StatSample.Kind.TENANT, slug, values) for slug, values in sorted(tenants.items())]
    rows += [(StatSample.Kind.TIER, name, _pick(tier, TIER_KEYS))
             for name, tier in (worker.get("tiers") or {}).items()]
    return rows


def sample_take(*, now: datetime | None = None) -> SampleResult:
    """Record one sample of every running worker and delete samples older than the retention."""
    cfg = sampler_config()
    now = now or timezone.now()
    at = sample_time(now, cfg.interval_seconds)
    # Ray calls (on the sample store's poll threads): outside the transaction, so no write lock is held
    stats = cluster_stats(refresh=True)
    # Only what answered this time: a stale sample would record the same figures twice.
    workers = [w for w in stats["workers"] if w.get("status") == "ok" and not w.get("stale")]
    rows = [StatSample(at=at, kind=kind, name=name, model=worker["model"], replica=worker.get("replica", 0),
                       values=values)
            for worker in workers for kind, name, values in worker_rows(worker)]
    with transaction.atomic():
        StatSample.objects.bulk_create(rows, ignore_conflicts=True)
        pruned, _ = StatSample.objects.filter(at__lt=now - timedelta(seconds=cfg.retention_seconds)).delete()
        from controlplane.ledger.services import ledger_accrue_sample

        ledger_accrue_sample(at=at, interval_seconds=cfg.interval_seconds, workers=workers)
    from controlplane.caches.repin import repin_restarted

    repin_restarted(workers)  # a replica that started anew gets its named caches' pins back
    return SampleResult(at=at, written=len(rows), pruned=pruned)

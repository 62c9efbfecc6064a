"""Writes to the ledger: one finished request (:func:`ledger_record`; several at once,
:func:`ledger_record_many`) and one stats sample's L3 storage (:func:`ledger_accrue_sample`).

Both increment the hour's row with ``F()`` updates (``UPDATE ... SET n = n + k``: the database adds,
so concurrent callers never lose each other's increments, on PostgreSQL and SQLite alike). The first
call of an hour finds no row and inserts it; a concurrent first call that lost the race to insert
gets an ``IntegrityError`` from the unique (tenant, model, hour) constraint and updates the row the
winner made instead. A call is one query (the update), two the first time in the hour.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from controlplane.ledger.models import (
    ALL_MODELS,
    MISS_REASONS,
    OTHER_REASON,
    REASON_ALIASES,
    LedgerHour,
    LedgerSample,
    miss_field,
)
from controlplane.tenants.models import Tenant

logger = logging.getLogger("controlplane.ledger")

SAMPLE_CLAIMS_KEPT = timedelta(days=1)
COUNT_MAX = 2**62  # one call adds at most this to a column (a BIGINT holds 2**63 - 1)
TIERS = ("l1", "l2", "l3")


def hour_of(at: datetime) -> datetime:
    """``at`` floored to the hour, in UTC (a naive ``at`` is taken as UTC)."""
    if timezone.is_naive(at):
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _count(value: Any) -> int:
    """A token count as a non-negative int (a missing, malformed or negative value counts 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return max(0, min(int(value), COUNT_MAX))


def usage_increments(usage: Mapping[str, Any], misses: Mapping[str, Any] | None = None) -> dict[str, int]:
    """The column increments of one request: ``usage`` is the response's OpenAI-shaped ``usage``,
    ``misses`` maps a miss reason to the prompt tokens lost for it (unknown reasons: ``other``)."""
    details = usage.get("prompt_tokens_details") or {}
    by_tier = details.get("cached_tokens_by_tier") or {}
    out = {
        "requests": 1,
        "prompt_tokens": _count(usage.get("prompt_tokens")),
        "completion_tokens": _count(usage.get("completion_tokens")),
        "cached_tokens": _count(details.get("cached_tokens")),
        "write_tokens": _count(details.get("cache_write_tokens")),
        **{f"cached_{tier}": _count(by_tier.get(tier)) for tier in TIERS},
    }
    for reason, tokens in (misses or {}).items():
        reason = REASON_ALIASES.get(reason, reason)
        if reason not in MISS_REASONS:
            logger.warning("ledger: unknown miss reason %r counted as %r", str(reason)[:40], OTHER_REASON)
            reason = OTHER_REASON
        field = miss_field(reason)
        out[field] = min(out.get(field, 0) + _count(tokens), COUNT_MAX)
    return out


def _increment(*, tenant_id: int, model: str, hour: datetime, amounts: Mapping[str, int]) -> None:
    amounts = {k: v for k, v in amounts.items() if v}
    if not amounts:
        return
    scope = LedgerHour.objects.filter(tenant_id=tenant_id, model=model, hour=hour)
    updates = {k: F(k) + v for k, v in amounts.items()}
    if scope.update(**updates):
        return
    try:
        with transaction.atomic():  # a savepoint when the caller is in a transaction
            LedgerHour.objects.create(tenant_id=tenant_id, model=model, hour=hour, **amounts)
    except IntegrityError:  # another caller created the hour's row first: add to it
        scope.update(**updates)


def ledger_record(*, tenant_id: int, model: str, usage: Mapping[str, Any],
                  misses: Mapping[str, int] | None = None, at: datetime | None = None) -> None:
    """Add one finished request (a completion, chat completion or named-cache prewarm, streamed or
    not) to its tenant's row for ``model`` and the hour of ``at`` (default now). Safe to call from
    many threads and processes at once; never loses an increment. Malformed counts count 0."""
    _increment(tenant_id=tenant_id, model=model, hour=hour_of(at or timezone.now()),
               amounts=usage_increments(usage, misses))


def ledger_record_many(records: Iterable[Mapping[str, Any]], at: datetime | None = None) -> None:
    """``ledger_record`` for several finished requests of the same hour at once (each record: its
    ``tenant_id``, ``model``, ``usage`` and optional ``misses``): their increments are added up per
    tenant and model first, so each row of the hour takes one update, however many requests it counts
    (the serving accountant's batches)."""
    sums: dict[tuple[int, str], dict[str, int]] = {}
    for record in records:
        into = sums.setdefault((record["tenant_id"], record["model"]), {})
        for name, value in usage_increments(record["usage"], record.get("misses")).items():
            into[name] = min(into.get(name, 0) + value, COUNT_MAX)
    hour = hour_of(at or timezone.now())
    for (tenant_id, model), amounts in sums.items():
        _increment(tenant_id=tenant_id, model=model, hour=hour, amounts=amounts)


def l3_bytes_by_tenant(workers: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """``{tenant id: L3 bytes}`` from ``runtime.stats.cluster_stats()["workers"]``.

    Every worker reports the shared L3 store's bytes per tenant (its index of the whole store, by
    tenant id: ``resident_blocks["l3"]`` x ``bytes_per_block``), so the figures are not added up
    across workers: a tenant's bytes are the largest any answering worker reports. Owners that are
    not tenant ids are skipped."""
    out: dict[int, int] = {}
    for worker in workers:
        if worker.get("status") != "ok":
            continue
        per_block = int(worker.get("bytes_per_block") or 0)
        for owner, blocks in ((worker.get("resident_blocks") or {}).get("l3") or {}).items():
            text = str(owner)
            if not (text.isascii() and text.isdigit()):
                continue
            nbytes = int(blocks) * per_block
            if nbytes > 0:
                out[int(text)] = max(out.get(int(text), 0), nbytes)
    return out


def ledger_accrue_sample(*, at: datetime, interval_seconds: int, workers: Iterable[Mapping[str, Any]]) -> int:
    """Accrue one stats sample's L3 storage: each tenant's L3 bytes (:func:`l3_bytes_by_tenant`) x
    ``interval_seconds`` into its :data:`ALL_MODELS` row of the hour of ``at``. Called by
    ``timeseries.services.sample_take`` inside its transaction; a sample time already accrued (a
    second sampler) adds nothing. Returns the number of tenants accrued."""
    resident = l3_bytes_by_tenant(workers)
    if not resident:
        return 0
    with transaction.atomic():
        _, claimed = LedgerSample.objects.get_or_create(at=at)
        if not claimed:
            return 0
        LedgerSample.objects.filter(at__lt=at - SAMPLE_CLAIMS_KEPT).delete()
        hour = hour_of(at)
        known = set(Tenant.objects.filter(pk__in=resident).values_list("pk", flat=True))
        for tenant_id, nbytes in sorted(resident.items()):
            if tenant_id in known:
                _increment(tenant_id=tenant_id, model=ALL_MODELS, hour=hour,
                           amounts={"l3_byte_seconds": nbytes * int(interval_seconds)})
    return len(known)

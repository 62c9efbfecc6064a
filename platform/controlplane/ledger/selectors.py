"""Reads of the ledger: hourly rows over a period (:func:`ledger_rows`), their sums
(:func:`ledger_totals`: the same figures, added up), per-model sums over a period (:func:`model_sums`)
and the all-time counters ``/metrics`` exposes (:func:`ledger_counters`).

A period is whole hours: ``since`` floored to its hour, ``until`` rounded up to the next one; a row
belongs to it when its hour starts inside ``[since, until)``. Defaults: ``until`` = now, ``since``
= 24 hours before ``until``; at most :data:`MAX_PERIOD`.

Pinned token-seconds are computed here, exactly, from the ``caches.NamedCache`` rows: a cache's
``pinned_tokens`` x the overlap of ``[created, min(expires_at, deleted_at, now))`` with each hour
(kept in integer token-microseconds, so the hours add up to the period without rounding). They
appear on the row of the cache's tenant, model and hour, which exists in the result even when no
request was recorded in that hour.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db.models import Q, Sum
from django.utils import timezone

from controlplane.caches.models import NamedCache
from controlplane.common.errors import InvalidInput
from controlplane.ledger.models import (
    MISS_FIELDS,
    MISS_REASONS,
    OTHER_REASON,
    SUM_FIELDS,
    TOKEN_FIELDS,
    LedgerHour,
    miss_field,
)
from controlplane.ledger.services import hour_of
from controlplane.tenants.models import Tenant

HOUR = timedelta(hours=1)
DEFAULT_PERIOD = timedelta(hours=24)
MAX_PERIOD = timedelta(days=366)
MICROSECOND = timedelta(microseconds=1)

Key = tuple[int, str, datetime]  # (tenant id, model, hour)


@dataclass
class LedgerRow:
    """One (tenant, model, hour) of the ledger, or the sum of many (``ledger_totals``: ``tenant``,
    ``model`` and ``hour`` are then what all of them share, else ``None``)."""

    tenant_id: int | None
    tenant: str | None  # slug
    model: str | None
    hour: datetime | None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SUM_FIELDS, 0))
    pinned_token_microseconds: int = 0

    @property
    def pinned_token_seconds(self) -> float:
        return self.pinned_token_microseconds / 1_000_000

    @property
    def misses(self) -> dict[str, int]:
        """``{reason: tokens}`` for every reason (zeros included; ``other`` only when non-zero)."""
        out = {r: self.counts[miss_field(r)] for r in MISS_REASONS}
        if self.counts[miss_field(OTHER_REASON)]:
            out[OTHER_REASON] = self.counts[miss_field(OTHER_REASON)]
        return out

    def add(self, other: LedgerRow) -> None:
        for key, value in other.counts.items():
            self.counts[key] += value
        self.pinned_token_microseconds += other.pinned_token_microseconds


def _aware(at: datetime) -> datetime:
    return at.replace(tzinfo=UTC) if timezone.is_naive(at) else at


def ledger_period(*, since: datetime | None = None, until: datetime | None = None,
                  now: datetime | None = None) -> tuple[datetime, datetime]:
    """``(start, end)``: the whole hours covering ``[since, until)``. Raises ``InvalidInput`` (422)
    when ``since`` is not before ``until``, the period is longer than :data:`MAX_PERIOD` or a time
    is out of range."""
    try:
        end_at = _aware(until) if until is not None else now or timezone.now()
        start_at = _aware(since) if since is not None else end_at - DEFAULT_PERIOD
        if not start_at < end_at:
            raise InvalidInput("since must be before until", code="invalid_period")
        start, end = hour_of(start_at), hour_of(end_at)
        if end < end_at:
            end += HOUR
    except (OverflowError, ValueError) as exc:
        raise InvalidInput("since or until is out of range", code="invalid_period") from exc
    if end - start > MAX_PERIOD:
        raise InvalidInput(f"the period is longer than {MAX_PERIOD.days} days", code="invalid_period")
    return start, end


def pinned_token_microseconds(*, start: datetime, end: datetime, now: datetime | None = None,
                              tenant: Tenant | None = None, model: str | None = None) -> dict[Key, int]:
    """``{(tenant id, model, hour): pinned tokens x microseconds}`` of the named caches pinned in
    ``[start, end)`` (hours: ``start`` on an hour), up to ``now`` at the latest."""
    now = now or timezone.now()
    stop = min(end, now)
    caches = NamedCache.objects.filter(pinned_tokens__gt=0, created__lt=stop, expires_at__gt=start).filter(
        Q(deleted_at__isnull=True) | Q(deleted_at__gt=start))
    if tenant is not None:
        caches = caches.filter(tenant=tenant)
    if model is not None:
        caches = caches.filter(deployment__name=model)
    out: dict[Key, int] = defaultdict(int)
    rows = caches.values_list("tenant_id", "deployment__name", "pinned_tokens", "created", "expires_at", "deleted_at")
    for tenant_id, name, tokens, created, expires_at, deleted_at in rows:
        lo = max(created, start)
        hi = min(expires_at, deleted_at or expires_at, stop)
        hour = hour_of(lo)
        while hour < hi:
            span = min(hi, hour + HOUR) - max(lo, hour)
            if span > timedelta(0):
                out[(tenant_id, name, hour)] += tokens * (span // MICROSECOND)
            hour += HOUR
    return dict(out)


def _caught_up() -> None:
    """Wait for this process's accountant (``serving.accountant``, which books finished requests off
    their response path) to book what it was given so far."""
    from controlplane.serving.accountant import drain

    drain()


def ledger_rows(*, tenant: Tenant | None = None, model: str | None = None, since: datetime | None = None,
                until: datetime | None = None, now: datetime | None = None) -> list[LedgerRow]:
    """The ledger's rows in the period (see the module docstring), ordered by hour, tenant slug and
    model; ``tenant`` and ``model`` narrow them. Offboarded tenants are included. Requests this
    process answered but has not booked yet are booked first (``_caught_up``)."""
    _caught_up()
    now = now or timezone.now()
    start, end = ledger_period(since=since, until=until, now=now)
    hours = LedgerHour.objects.filter(hour__gte=start, hour__lt=end)
    if tenant is not None:
        hours = hours.filter(tenant=tenant)
    if model is not None:
        hours = hours.filter(model=model)
    rows: dict[Key, LedgerRow] = {}
    for values in hours.values("tenant_id", "tenant__slug", "model", "hour", *SUM_FIELDS):
        key = (values["tenant_id"], values["model"], values["hour"])
        rows[key] = LedgerRow(tenant_id=key[0], tenant=values["tenant__slug"], model=key[1], hour=key[2],
                              counts={f: values[f] for f in SUM_FIELDS})
    pinned = pinned_token_microseconds(start=start, end=end, now=now, tenant=tenant, model=model)
    missing = {tenant_id for tenant_id, _, _ in pinned} - {r.tenant_id for r in rows.values()}
    slugs = {r.tenant_id: r.tenant for r in rows.values()}
    slugs.update(Tenant.objects.filter(pk__in=missing).values_list("pk", "slug"))
    for key, microseconds in pinned.items():
        row = rows.get(key)
        if row is None:
            row = rows[key] = LedgerRow(tenant_id=key[0], tenant=slugs.get(key[0], str(key[0])), model=key[1],
                                        hour=key[2])
        row.pinned_token_microseconds += microseconds
    return sorted(rows.values(), key=lambda r: (r.hour, r.tenant, r.model))


def totals_of(rows: list[LedgerRow]) -> LedgerRow:
    """The sum of ``rows`` (``tenant``/``model``/``hour`` kept where every row shares it)."""
    def shared(attr: str):
        values = {getattr(r, attr) for r in rows}
        return values.pop() if len(values) == 1 else None

    total = LedgerRow(tenant_id=shared("tenant_id"), tenant=shared("tenant"), model=shared("model"), hour=None)
    for row in rows:
        total.add(row)
    return total


def ledger_totals(*, tenant: Tenant | None = None, model: str | None = None, since: datetime | None = None,
                  until: datetime | None = None, now: datetime | None = None) -> LedgerRow:
    """The sums over the period of exactly the figures :func:`ledger_rows` lists."""
    total = totals_of(ledger_rows(tenant=tenant, model=model, since=since, until=until, now=now))
    if tenant is not None:
        total.tenant_id, total.tenant = tenant.pk, tenant.slug
    if model is not None:
        total.model = model
    return total


def model_sums(*, models: list[str], tenant: Tenant | None = None, since: datetime | None = None,
               until: datetime | None = None, now: datetime | None = None) -> dict[str, dict[str, int]]:
    """Per model of ``models`` (every tenant's, or ``tenant``'s), the period's sums of the request and
    token counters (``requests`` and ``TOKEN_FIELDS``); a model without a row is left out. One query:
    the console's adapter tables."""
    _caught_up()
    start, end = ledger_period(since=since, until=until, now=now or timezone.now())
    hours = LedgerHour.objects.filter(hour__gte=start, hour__lt=end, model__in=list(models))
    if tenant is not None:
        hours = hours.filter(tenant=tenant)
    fields = ("requests", *TOKEN_FIELDS)
    sums = hours.values("model").annotate(**{f"sum_{f}": Sum(f) for f in fields}).order_by()
    return {v["model"]: {f: v[f"sum_{f}"] or 0 for f in fields} for v in sums}


def ledger_counters() -> list[LedgerRow]:
    """All-time sums per (tenant, model) of the token and miss counters (the monotonic counters of
    ``/metrics``), tenant slug and model order; storage-only rows (no request) are left out."""
    _caught_up()
    fields = ("requests", *TOKEN_FIELDS, *MISS_FIELDS)
    sums = (LedgerHour.objects.filter(requests__gt=0).values("tenant_id", "tenant__slug", "model")
            .annotate(**{f"sum_{f}": Sum(f) for f in fields}).order_by("tenant__slug", "model"))
    out = []
    for values in sums:
        row = LedgerRow(tenant_id=values["tenant_id"], tenant=values["tenant__slug"], model=values["model"], hour=None)
        row.counts.update({f: values[f"sum_{f}"] or 0 for f in fields})
        out.append(row)
    return out


"""/api/admin/tenants/{slug}/ledger and /api/admin/ledger: the cache ledger by hour, as JSON or CSV.

Query parameters (all optional): ``since`` and ``until`` (ISO 8601; a time without a zone is UTC;
whole hours, see ``ledger.selectors``; default the last 24 hours), ``model`` (a deployment name;
``*`` for the L3 storage rows) and ``format`` (``json`` or ``csv``). Viewers may read; offboarded
tenants keep their ledger. A bad parameter is a 422 in the JSON error shape, whatever ``format``
asks for.

CSV: a header row, then one line per row, with the miss reasons as ``miss_<reason>`` columns and
``pinned_token_seconds`` written exactly (six decimals); sent as an attachment.
"""

from __future__ import annotations

import csv
import io
from datetime import datetime
from typing import Any, Literal

from django.http import HttpResponse
from ninja import Query, Router, Schema
from pydantic import Field

from controlplane.common.query import QueryText
from controlplane.ledger.models import MISS_REASONS, OTHER_REASON, TOKEN_FIELDS, miss_field
from controlplane.ledger.selectors import LedgerRow, ledger_period, ledger_rows, totals_of
from controlplane.tenants.models import Tenant
from controlplane.tenants.selectors import tenant_get

router = Router(tags=["ledger"])

COUNT_COLUMNS = ("requests", *TOKEN_FIELDS)
CSV_COLUMNS = ("tenant", "model", "hour", *COUNT_COLUMNS, "pinned_token_seconds", "l3_byte_seconds",
               *(miss_field(r) for r in (*MISS_REASONS, OTHER_REASON)))


class LedgerFilters(Schema):
    since: datetime | None = Field(default=None, description="start (floored to the hour); default until - 24 h")
    until: datetime | None = Field(default=None, description="end, exclusive (rounded up to the hour); default now")
    model: QueryText | None = Field(default=None, description="one model's rows ('*': the L3 storage rows)")
    format: Literal["json", "csv"] = Field(default="json", description="json, or csv (an attachment)")


class LedgerRowOut(Schema):
    tenant: str | None
    model: str | None
    hour: datetime | None = Field(description="the hour's start (UTC); null in the totals")
    requests: int
    prompt_tokens: int = Field(description="prompt tokens presented to the cache")
    completion_tokens: int
    cached_tokens: int = Field(description="prompt tokens whose prefill was skipped")
    cached_l1: int
    cached_l2: int
    cached_l3: int
    write_tokens: int = Field(description="prompt tokens added to the cache")
    pinned_token_seconds: float = Field(description="named caches' pinned tokens x seconds pinned")
    l3_byte_seconds: int = Field(description="bytes held in L3 x seconds (model '*')")
    misses: dict[str, int] = Field(description="prompt tokens not reused, by miss reason")


class LedgerOut(Schema):
    tenant: str | None = Field(description="the tenant asked for; null for all tenants")
    model: str | None
    since: datetime
    until: datetime
    rows: list[LedgerRowOut]
    totals: LedgerRowOut


def row_out(row: LedgerRow) -> dict[str, Any]:
    return {"tenant": row.tenant, "model": row.model, "hour": row.hour,
            **{f: row.counts[f] for f in COUNT_COLUMNS},
            "pinned_token_seconds": row.pinned_token_seconds, "l3_byte_seconds": row.counts["l3_byte_seconds"],
            "misses": row.misses}


def _seconds(microseconds: int) -> str:
    return f"{microseconds // 1_000_000}.{microseconds % 1_000_000:06d}"


def _csv_line(row: LedgerRow) -> list[Any]:
    return [row.tenant, row.model, row.hour.isoformat() if row.hour else "", *(row.counts[f] for f in COUNT_COLUMNS),
            _seconds(row.pinned_token_microseconds), row.counts["l3_byte_seconds"],
            *(row.counts[miss_field(r)] for r in (*MISS_REASONS, OTHER_REASON))]


def ledger_csv(rows: list[LedgerRow], *, name: str) -> HttpResponse:
    """``rows`` as a CSV attachment named ``name``.csv (header row first)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    writer.writerows(_csv_line(r) for r in rows)
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
    return response


def _answer(filters: LedgerFilters, tenant: Tenant | None):
    start, end = ledger_period(since=filters.since, until=filters.until)  # 422 before any read
    rows = ledger_rows(tenant=tenant, model=filters.model, since=start, until=end)
    if filters.format == "csv":
        return ledger_csv(rows, name=f"ledger-{tenant.slug if tenant else 'all'}-{start:%Y%m%dT%H}-{end:%Y%m%dT%H}")
    totals = totals_of(rows)
    totals.tenant, totals.model = (tenant.slug if tenant else None), filters.model
    return {"tenant": tenant.slug if tenant else None, "model": filters.model, "since": start, "until": end,
            "rows": [row_out(r) for r in rows], "totals": row_out(totals)}


@router.get("tenants/{slug}/ledger", response=LedgerOut)
def tenant_ledger(request, slug: str, filters: Query[LedgerFilters]):
    """One tenant's ledger by hour and model (offboarded tenants too)."""
    return _answer(filters, tenant_get(slug=slug))


@router.get("ledger", response=LedgerOut)
def all_ledger(request, filters: Query[LedgerFilters]):
    """Every tenant's ledger by hour, tenant and model."""
    return _answer(filters, None)

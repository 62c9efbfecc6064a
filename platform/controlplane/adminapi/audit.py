"""/api/admin/audit: filtered, paged listing (newest first) and chain verification."""

from __future__ import annotations

from datetime import datetime

from ninja import Query, Router, Schema
from pydantic import Field

from controlplane.adminapi.present import audit_event_out
from controlplane.adminapi.schemas import AuditPageOut, AuditVerifyOut
from controlplane.audit.selectors import audit_list, audit_verify
from controlplane.common.query import QueryRowNumber, QueryText

router = Router(tags=["audit"])


class AuditFilters(Schema):
    action: QueryText | None = Field(default=None, description="exact action, or a prefix ending in '.'")
    actor: QueryText | None = None
    tenant: QueryText | None = None
    since: datetime | None = Field(default=None, description="inclusive")
    until: datetime | None = Field(default=None, description="exclusive")
    before: QueryRowNumber | None = Field(default=None, description="page backwards: events with seq < before")
    limit: int = Field(default=100, ge=1, le=1000)


@router.get("audit", response=AuditPageOut)
def list_audit(request, filters: Query[AuditFilters]):
    events = audit_list(
        action=filters.action, actor=filters.actor, tenant=filters.tenant, since=filters.since,
        until=filters.until, before_seq=filters.before, limit=filters.limit,
    )
    next_before = events[-1].seq if len(events) == filters.limit else None
    return {"items": [audit_event_out(e) for e in events], "next_before": next_before}


@router.get("audit/verify", response=AuditVerifyOut)
def verify_audit(request):
    return audit_verify()

"""Audit reads: filtered listing and chain verification."""

from __future__ import annotations

from datetime import datetime
from typing import TypedDict

from django.db.models import QuerySet

from controlplane.audit.chain import event_hash
from controlplane.audit.models import GENESIS_HASH, AuditEvent, AuditHead


class VerifyResult(TypedDict):
    ok: bool
    length: int  # number of events in the log
    head: str  # hash of the last event (GENESIS_HASH for an empty log)
    first_bad: int | None  # seq of the first record that does not verify (or is missing)


def audit_list(
    *,
    action: str | None = None,
    actor: str | None = None,
    tenant: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    before_seq: int | None = None,
    limit: int = 100,
) -> list[AuditEvent]:
    """Newest first, at most ``limit``. ``action`` matches exactly or as a prefix ending in ``.``
    (``tenant.`` = every tenant action); ``since`` inclusive, ``until`` exclusive; ``before_seq``
    pages backwards."""
    qs: QuerySet[AuditEvent] = AuditEvent.objects.all()
    if action:
        qs = qs.filter(action__startswith=action) if action.endswith(".") else qs.filter(action=action)
    if actor:
        qs = qs.filter(actor=actor)
    if tenant:
        qs = qs.filter(tenant=tenant)
    if since:
        qs = qs.filter(time__gte=since)
    if until:
        qs = qs.filter(time__lt=until)
    if before_seq is not None:
        qs = qs.filter(seq__lt=before_seq)
    return list(qs.order_by("-seq")[:limit])


def audit_verify(*, chunk_size: int = 2000) -> VerifyResult:
    """Recompute the whole chain, streaming (constant memory), and name the first bad record.

    A record is bad when its seq is not the next one (the missing seq is named), its ``prev_hash``
    is not its predecessor's hash, or its own hash does not match its contents. The chain head row
    must also agree with the last record, which catches a truncated (or extended) tail.
    """
    expected_seq, prev_hash, length, first_bad = 1, GENESIS_HASH, 0, None
    last_seq = 0
    for event in AuditEvent.objects.order_by("seq").iterator(chunk_size=chunk_size):
        if first_bad is None:
            if event.seq != expected_seq:
                first_bad = expected_seq
            elif event.prev_hash != prev_hash or event_hash(event) != event.hash:
                first_bad = event.seq
        length += 1
        last_seq, prev_hash, expected_seq = event.seq, event.hash, event.seq + 1
    head = AuditHead.objects.filter(pk=1).first()
    if first_bad is None and head is not None and (head.seq, head.hash) != (last_seq, prev_hash):
        first_bad = min(head.seq, last_seq) + 1 if head.seq != last_seq else last_seq
    return {"ok": first_bad is None, "length": length, "head": prev_hash, "first_bad": first_bad}

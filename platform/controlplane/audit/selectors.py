"""Audit reads: filtered listing and chain verification."""

from __future__ import annotations

from datetime import datetime
from typing import TypedDict

from django.db.models import QuerySet

from controlplane.audit.chain import event_hash
from controlplane.audit.headlog import head_log_read
from controlplane.audit.models import GENESIS_HASH, AuditEvent, AuditHead


class VerifyResult(TypedDict):
    ok: bool
    length: int  # number of events in the log
    head: str  # hash of the last event (GENESIS_HASH for an empty log)
    first_bad: int | None  # seq of the first record that does not verify (or is missing)
    problem: str | None  # why first_bad is bad (None when ok)


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


def _stream(after: int, chunk_size: int, upto: int | None = None):
    qs = AuditEvent.objects.filter(seq__gt=after)
    if upto is not None:
        qs = qs.filter(seq__lte=upto)
    return qs.order_by("seq").iterator(chunk_size=chunk_size)


def audit_verify(*, chunk_size: int = 2000) -> VerifyResult:
    """Recompute the whole chain, streaming (constant memory), and name the first bad record.

    A record is bad when its seq is not the next one (the missing seq is named), its ``prev_hash``
    is not its predecessor's hash, or its keyed hash does not match its contents. Then the ends:

    - the head row must exist once there are events and agree with the last record: a missing head
      names the last record; a head behind it (rewound) names the first record past the head; a
      head ahead of it (tail deleted) names the first missing seq; a wrong hash names the last;
    - the external head log (``headlog``) must not be ahead of the database (a truncated tail,
      even with the head rewound to match, names the first missing seq), and the record at the
      seq it names must carry the hash it names. It may lag (a write lost after commit).

    ``first_bad`` is the lowest seq any check names and ``problem`` says why. Appends that commit
    while this runs are read too (the head only moves forward), so they never look like tampering.
    """
    external = head_log_read()  # before the rows: anything appended later may only put the file behind
    candidates: list[tuple[int, str]] = []
    state = {"expected": 1, "prev": GENESIS_HASH, "length": 0, "last": 0, "at_external": None}

    def walk(events) -> None:
        for event in events:
            if not candidates:
                if event.seq != state["expected"]:
                    candidates.append((state["expected"], f"record {state['expected']} is missing"))
                elif event.prev_hash != state["prev"]:
                    candidates.append((event.seq, f"record {event.seq} does not link to its predecessor"))
                elif event_hash(event) != event.hash:
                    candidates.append((event.seq, f"record {event.seq} does not match its hash"))
            if external is not None and event.seq == external.seq:
                state["at_external"] = event.hash
            state["length"] += 1
            state.update(last=event.seq, prev=event.hash, expected=event.seq + 1)

    walk(_stream(0, chunk_size))
    head = AuditHead.objects.filter(pk=1).first()
    if head is not None and head.seq > state["last"]:
        walk(_stream(state["last"], chunk_size, upto=head.seq))  # appended while we were reading
    last, length = state["last"], state["length"]
    if head is None:
        if length:
            candidates.append((last, "the chain head record is missing"))
    elif head.seq < last:
        candidates.append((head.seq + 1, f"the chain head was rewound to {head.seq}; the log holds {last}"))
    elif head.seq > last:
        candidates.append((last + 1, f"the chain head is at {head.seq} but the log ends at {last}"))
    elif head.hash != state["prev"]:
        candidates.append((last, f"the chain head's hash does not match record {last}"))
    if external is not None:
        if external.seq > last:
            candidates.append((last + 1, f"the external head log records {external.seq} but the log ends "
                                         f"at {last}: its tail was removed"))
        elif external.seq > 0 and state["at_external"] != external.hash:
            candidates.append((external.seq, f"record {external.seq} differs from the external head log"))
    first_bad, problem = min(candidates) if candidates else (None, None)
    return {"ok": first_bad is None, "length": length, "head": state["prev"], "first_bad": first_bad,
            "problem": problem}


class HeadStatus(TypedDict):
    database: int | None  # seq of the head row (None: no row)
    file: int | None  # seq the external head log names (None: no file or no line)


def audit_head_status() -> HeadStatus:
    """Both recorded heads, for /metrics (cheap: one row and a file tail)."""
    external = head_log_read()
    return {"database": AuditHead.objects.filter(pk=1).values_list("seq", flat=True).first(),
            "file": external.seq if external else None}

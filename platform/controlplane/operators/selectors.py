"""Operator reads: token authentication, tokens, recent login lockouts."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.common.tokens import secret_matches, secret_prefix
from controlplane.operators.models import OperatorToken

LOCKOUT_EVENTS_READ = 500  # newest lockout events looked at: the log grows by a bounded number per minute


def operator_token_match(raw_token: str) -> OperatorToken | None:
    """The token matching ``raw_token`` whatever its state (prefix lookup, constant-time digest
    compare), or ``None`` when none does."""
    if not isinstance(raw_token, str) or not raw_token:
        return None
    match = None
    candidates = list(OperatorToken.objects.filter(prefix=secret_prefix(raw_token)))
    for token in candidates or [None]:
        if secret_matches(raw_token, token.token_hash if token else None) and match is None:
            match = token
    return match


def operator_authenticate(raw_token: str) -> OperatorToken | None:
    """The live token matching ``raw_token``, or ``None`` for unknown, revoked and expired tokens alike."""
    match = operator_token_match(raw_token)
    if match is None or match.state(timezone.now()) != "live":
        return None
    return match


def operator_token_list() -> list[OperatorToken]:
    return list(OperatorToken.objects.all())


def login_lockouts_recent(*, within: timedelta = timedelta(hours=1), limit: int = 20) -> list[dict]:
    """Login lockouts (``auth.lockout`` events) of the last ``within``, newest first, one row per
    (account, source): ``account`` (``*``: a source-wide lockout), ``source``, ``until`` (aware
    datetime), ``active`` (still locked), ``failures``, ``count`` (lockouts the row's events
    aggregate)."""
    now = timezone.now()
    events = AuditEvent.objects.filter(action="auth.lockout", time__gte=now - within).order_by("-seq")
    rows: dict[tuple[str, str], dict] = {}
    for event in events[:LOCKOUT_EVENTS_READ]:
        new = event.new_value or {}
        key = (str(new.get("account", event.actor)), event.source)
        if key in rows:
            rows[key]["count"] += int(new.get("count", 1))
            continue
        if len(rows) >= limit:
            continue
        try:
            until = datetime.fromisoformat(str(new.get("until")))
        except ValueError:
            until = event.time  # a pooled event carries no single lock's end
        rows[key] = {"account": key[0], "source": key[1], "until": until, "active": until > now,
                     "failures": new.get("failures"), "count": int(new.get("count", 1))}
    return list(rows.values())

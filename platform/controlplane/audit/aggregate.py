"""Aggregated audit events for anonymous failures (bad tokens, failed logins), so that traffic nobody
authenticated cannot grow the append-only log without bound (docs/design.md section 4).

Per key (action, kind, source, subject) at most one event is written per window: the first failure
of a window becomes an event whose ``new`` carries ``count``, the number of failures of that key
since its previous event (this one included), so the sum of ``count`` over a key's events is every
failure but those of its still-open window. The others are only counted (in the cache, see
``common.throttle``). When more than :data:`EVENTS_PER_WINDOW` keys open a window in one window,
the rest are pooled under source ``*`` (one event per action and kind and window): the log grows by
a bounded number of events per minute whatever the number of sources.
"""

from __future__ import annotations

import time
from typing import Any

from controlplane.audit.models import AuditEvent
from controlplane.audit.services import audit_record
from controlplane.common.throttle import throttle_tally_add, throttle_tally_take, throttle_window_open

SCOPE = "audit-agg"
WINDOW_S = 60
EVENTS_PER_WINDOW = 100
POOLED = "*"
# Per-key tallies and gates (one pair per source and subject: anonymous traffic makes them at will)
# live in the default cache, where losing one costs at most one extra event; the window's cap and
# the pooled keys (a few per window) in the lockouts store, which traffic cannot evict, so the
# events of a window stay at most EVENTS_PER_WINDOW plus one per action and kind.
STORE = "default"
BOUNDS = "lockouts"


def _window_full(window_s: int) -> bool:
    window = int(time.time() // window_s)
    opened = throttle_tally_add(scope=f"{SCOPE}-cap", key=str(window), ttl_s=2 * window_s, store=BOUNDS)
    return opened > EVENTS_PER_WINDOW


def audit_failure_record(
    *,
    action: str,
    kind: str,
    source: str,
    actor: str,
    auth_method: str,
    target: str,
    reason: str,
    subject: str = "",
    detail: dict[str, Any] | None = None,
    window_s: int | None = None,
    peer: str = "",
    forwarded_for: str = "",
) -> AuditEvent | None:
    """Count one failure; return the event when this failure is the one that writes it.

    ``action`` is ``auth.failed`` or ``auth.throttled``; ``kind`` what failed (``token``,
    ``login``); ``subject`` narrows the key (the account a login tried; never a secret);
    ``detail`` is merged into ``new`` (with ``kind``, ``count``, ``window_seconds``); ``peer`` and
    ``forwarded_for`` (how ``source`` was derived) are those of the failure that writes the event.
    """
    window_s = window_s or WINDOW_S
    key = "\x1f".join((action, kind, source, subject))
    throttle_tally_add(scope=SCOPE, key=key, store=STORE)
    if not throttle_window_open(scope=SCOPE, key=key, window_s=window_s, store=STORE):
        return None
    if _window_full(window_s):
        count = throttle_tally_take(scope=SCOPE, key=key, store=STORE)
        pooled = "\x1f".join((action, kind, POOLED, POOLED))
        throttle_tally_add(scope=SCOPE, key=pooled, amount=count, store=BOUNDS)
        if not throttle_window_open(scope=SCOPE, key=pooled, window_s=window_s, store=BOUNDS):
            return None
        key, source, actor, detail = pooled, POOLED, POOLED, {"pooled": True}
        peer = forwarded_for = ""
        reason = f"{reason} (from many sources: pooled)"
    count = max(1, throttle_tally_take(scope=SCOPE, key=key, store=BOUNDS if source == POOLED else STORE))
    new = {"kind": kind, "count": count, "window_seconds": window_s, **(detail or {})}
    return audit_record(actor=actor, auth_method=auth_method, source=source, action=action, target=target,
                        reason=reason, new=new, result="denied", peer=peer, forwarded_for=forwarded_for)

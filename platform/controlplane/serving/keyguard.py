"""Bad tenant API keys on the serving API: throttled and audited per source, like operator tokens
(``operators.authguard``), and, like them, only failures are: a valid key is served whatever others
sent from its address (tenants behind one NAT or proxy address cannot lock each other out).

A source (``common.sources``; an IPv6 /64) that presents :data:`FAILURE_LIMIT` unknown, revoked or
malformed keys within :data:`WINDOW_S` is locked for :data:`LOCKOUT_S`: meanwhile a key that is not
even shaped like one is refused (429) without a database lookup, a well-formed one is checked, and a
bad one is refused (429). Failures are audited as aggregated ``auth.failed`` events (kind
``api_key``, the key's visible prefix, never the key), refusals as ``auth.throttled``. Requests with
no key at all are answered 401 and neither counted nor audited.
"""

from __future__ import annotations

import re

from controlplane.audit.aggregate import audit_failure_record
from controlplane.common.errors import RateLimited
from controlplane.common.sources import RequestSource
from controlplane.common.throttle import source_bucket, throttle_failure, throttle_retry_after
from controlplane.common.tokens import secret_prefix

FAILURE_LIMIT = 20
WINDOW_S = 60
LOCKOUT_S = 60
KEY_SHAPE = re.compile(r"sk-st-[A-Za-z0-9_-]{43}")  # what tenants.services issues
_SCOPE = "tenant-key-source"


def api_key_retry_after(*, where: RequestSource) -> int | None:
    """Seconds until bad keys from ``where`` stop being refused; ``None`` when it is not locked."""
    return throttle_retry_after(scope=_SCOPE, key=source_bucket(where.source))


def api_key_worth_checking(key: str, *, retry_after: int | None) -> bool:
    """Whether to look ``key`` up: always, unless its source is locked and it cannot be a key."""
    return retry_after is None or KEY_SHAPE.fullmatch(key) is not None


def api_key_rejected(*, where: RequestSource, key: str, target: str, retry_after: int | None) -> None:
    """Record a key that did not authenticate. Raises :class:`RateLimited` (429) while ``where`` is
    locked; otherwise counts the failure and returns (the caller answers 401)."""
    via = {"source": where.source, "peer": where.peer, "forwarded_for": where.forwarded_for}
    if retry_after is not None:
        audit_failure_record(action="auth.throttled", kind="api_key", actor="anonymous", auth_method="api_key",
                             target=target, reason="too many bad API keys from this source", **via)
        raise RateLimited("too many failed authentication attempts from this address; retry later",
                          retry_after=retry_after, code="auth_throttled")
    throttle_failure(scope=_SCOPE, key=source_bucket(where.source), limit=FAILURE_LIMIT, window_s=WINDOW_S,
                     lockout_s=LOCKOUT_S)
    shown = secret_prefix(key) if key.startswith("sk-st-") else "?"
    audit_failure_record(action="auth.failed", kind="api_key", actor=f"key:{shown}", auth_method="api_key",
                         target=target, reason="unknown or revoked API key", **via)

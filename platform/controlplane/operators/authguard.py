"""Throttling and auditing of operator authentication: bearer tokens on the admin API and password
logins (the operator UI and the Django admin). Sources come from ``common.sources`` (the TCP peer, or
the client named by a trusted proxy).

Tokens: failures are throttled, successes never are. A source (an address; an IPv6 /64) that
presents :data:`TOKEN_FAILURE_LIMIT` bad or malformed tokens within :data:`TOKEN_WINDOW_S` is
locked for :data:`TOKEN_LOCKOUT_S`; while locked, a credential that is not even shaped like a token
is answered 429 without any lookup, and a well-formed one is still checked: a valid token is served
(so anonymous clients behind the same proxy address cannot lock operators out), a bad one gets 429.

Logins are throttled per (account, source): the first :data:`LOGIN_FREE_FAILURES` failures of an
account from one source cost nothing; each further one locks that pair for a delay starting at
:data:`LOGIN_DELAY_S` and doubling per failure, capped at :data:`LOGIN_DELAY_MAX_S`. Failures are
forgotten :data:`LOGIN_MEMORY_S` after the last one; a successful login clears its pair. A source
failing across many accounts is slowed the same way from :data:`LOGIN_SOURCE_FREE_FAILURES` on.
While locked, attempts get the lockout page (429) and no password is checked. The account itself is
never locked: a correct password from a source without failures always gets in. Past
:data:`LOGIN_ACCOUNT_CEILING` failures of one account from all sources within the memory window (a
distributed guess), every source gets a single free failure for that account instead of five, which
still lets a clean source in.

Every failure, refusal and lockout is audited through ``audit.aggregate`` (``auth.failed``,
``auth.throttled``, ``auth.lockout`` with the account, the source and the time the lock ends; at
most one event per key per minute carrying a count); a successful login is an ``auth.login`` event.
Never the presented token or password: a token appears as its visible prefix.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from controlplane.audit.aggregate import audit_failure_record
from controlplane.audit.models import AuditEvent
from controlplane.audit.services import audit_record
from controlplane.common.sources import RequestSource
from controlplane.common.throttle import (
    source_bucket,
    throttle_backoff_failure,
    throttle_clear,
    throttle_failure,
    throttle_retry_after,
    throttle_tally_add,
)

TOKEN_FAILURE_LIMIT = 10
TOKEN_WINDOW_S = 60
TOKEN_LOCKOUT_S = 60
TOKEN_SHAPE = re.compile(r"st-op-[A-Za-z0-9_-]{43}")  # what operators.services issues

LOGIN_FREE_FAILURES = 5
LOGIN_SOURCE_FREE_FAILURES = 20
LOGIN_DELAY_S = 60
LOGIN_DELAY_MAX_S = 15 * 60
LOGIN_MEMORY_S = 60 * 60
LOGIN_ACCOUNT_CEILING = 100

_TOKEN_SCOPE = "op-token-source"
_LOGIN_PAIR_SCOPE = "op-login-pair"
_LOGIN_SOURCE_SCOPE = "op-login-source"
_LOGIN_ACCOUNT_SCOPE = "op-login-account"
ANY_ACCOUNT = "*"  # the account of a source-wide lockout


def _account(username: str) -> str:
    return username.strip().casefold()[:150]


def _pair(username: str, where: RequestSource) -> str:
    return f"{_account(username)}\x1f{source_bucket(where.source)}"


def _via(where: RequestSource) -> dict[str, str]:
    return {"source": where.source, "peer": where.peer, "forwarded_for": where.forwarded_for}


# ---------------------------------------------------------------------- bearer tokens
def token_auth_retry_after(*, where: RequestSource) -> int | None:
    """Seconds until failures from ``where`` stop being refused; ``None`` when it is not locked."""
    return throttle_retry_after(scope=_TOKEN_SCOPE, key=source_bucket(where.source))


def token_well_formed(token: str) -> bool:
    """Could ``token`` be an operator token at all (checked before any lookup while locked)?"""
    return TOKEN_SHAPE.fullmatch(token) is not None


def token_auth_failed(*, where: RequestSource, presented: str, target: str, reason: str) -> None:
    """Count a bad or malformed token from ``where`` (``presented``: its visible prefix or ``?``)."""
    throttle_failure(scope=_TOKEN_SCOPE, key=source_bucket(where.source), limit=TOKEN_FAILURE_LIMIT,
                     window_s=TOKEN_WINDOW_S, lockout_s=TOKEN_LOCKOUT_S)
    audit_failure_record(action="auth.failed", kind="token", actor=presented, auth_method="token",
                         target=target, reason=reason, **_via(where))


def token_auth_refused(*, where: RequestSource, target: str) -> None:
    """Record a bad token refused (429) because its source is locked."""
    audit_failure_record(action="auth.throttled", kind="token", actor="anonymous", auth_method="token",
                         target=target, reason="too many bad tokens from this source", **_via(where))


# ---------------------------------------------------------------------- password logins
def login_retry_after(*, username: str, where: RequestSource) -> int | None:
    """Seconds until ``username`` may try to log in from ``where``; ``None`` when it may now."""
    waits = [throttle_retry_after(scope=_LOGIN_PAIR_SCOPE, key=_pair(username, where)) if username else None,
             throttle_retry_after(scope=_LOGIN_SOURCE_SCOPE, key=source_bucket(where.source))]
    waits = [wait for wait in waits if wait is not None]
    return max(waits) if waits else None


def _lockout_audit(*, account: str, where: RequestSource, via: str, failures: int, delay: int) -> None:
    until = datetime.now(UTC) + timedelta(seconds=delay)
    audit_failure_record(action="auth.lockout", kind="login", subject=account, actor=account or "anonymous",
                         auth_method="password", target=f"login:{via}",
                         reason=f"{failures} failed logins: locked for {delay} s",
                         detail={"account": account, "until": until.isoformat(timespec="seconds"),
                                 "seconds": delay, "failures": failures}, **_via(where))


def login_failed(*, username: str, where: RequestSource, via: str, reason: str) -> None:
    """Count a failed login of ``username`` from ``where`` through ``via`` (``ui`` / ``admin``); lock
    the (account, source) pair or the source when their backoff starts, and audit that lockout."""
    account = _account(username)
    shown = username.strip()[:150]
    # Failures of this account from every source, counted from the first one in the memory window.
    total = throttle_tally_add(scope=_LOGIN_ACCOUNT_SCOPE, key=account, ttl_s=LOGIN_MEMORY_S) if account else 0
    audit_failure_record(action="auth.failed", kind="login", subject=account, actor=shown or "anonymous",
                         auth_method="password", target=f"login:{via}", reason=reason, detail={"account": shown},
                         **_via(where))
    checks = [(_LOGIN_SOURCE_SCOPE, source_bucket(where.source), LOGIN_SOURCE_FREE_FAILURES, ANY_ACCOUNT)]
    if account:
        free = 1 if total > LOGIN_ACCOUNT_CEILING else LOGIN_FREE_FAILURES
        checks.insert(0, (_LOGIN_PAIR_SCOPE, _pair(username, where), free, shown))
    for scope, key, free, who in checks:
        failures, delay = throttle_backoff_failure(scope=scope, key=key, free=free, base_s=LOGIN_DELAY_S,
                                                   cap_s=LOGIN_DELAY_MAX_S, memory_s=LOGIN_MEMORY_S)
        if delay is not None:
            _lockout_audit(account=who, where=where, via=via, failures=failures, delay=delay)


def login_refused(*, username: str, where: RequestSource, via: str) -> None:
    """Record a login refused (lockout page) without checking its password."""
    account = username.strip()[:150]
    audit_failure_record(action="auth.throttled", kind="login", subject=_account(username),
                         actor=account or "anonymous", auth_method="password", target=f"login:{via}",
                         reason="too many failed logins for this account from this source, or from this source",
                         detail={"account": account}, **_via(where))


def login_succeeded(*, username: str, where: RequestSource, via: str) -> AuditEvent:
    """Record a successful login (an ``auth.login`` event) and clear its (account, source) failures."""
    throttle_clear(scope=_LOGIN_PAIR_SCOPE, key=_pair(username, where))
    return audit_record(actor=username[:150], auth_method="password", action="auth.login", target=f"login:{via}",
                        **_via(where))

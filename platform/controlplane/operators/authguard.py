"""Throttling and auditing of operator authentication: bearer tokens on the admin API and password
logins (the operator UI and the Django admin).

Tokens: a source (an address; an IPv6 /64) that presents :data:`TOKEN_FAILURE_LIMIT` bad or
malformed tokens within :data:`TOKEN_WINDOW_S` is answered 429 with ``Retry-After`` for
:data:`TOKEN_LOCKOUT_S`, whatever it presents (no token is checked meanwhile).

Logins: an account with :data:`LOGIN_ACCOUNT_LIMIT` failures, or a source with
:data:`LOGIN_SOURCE_LIMIT`, within :data:`LOGIN_WINDOW_S` is locked for :data:`LOGIN_LOCKOUT_S`:
attempts get the lockout page (429) and no password is checked. A successful login clears its
account's count (not its source's).

Every failure and refusal is audited through ``audit.aggregate`` (``auth.failed`` /
``auth.throttled``, at most one event per key per minute carrying a count); a successful login is an
``auth.login`` event. Never the presented token or password: a token appears as its visible prefix.
"""

from __future__ import annotations

from controlplane.audit.aggregate import audit_failure_record
from controlplane.audit.models import AuditEvent
from controlplane.audit.services import audit_record
from controlplane.common.throttle import source_bucket, throttle_clear, throttle_failure, throttle_retry_after

TOKEN_FAILURE_LIMIT = 10
TOKEN_WINDOW_S = 60
TOKEN_LOCKOUT_S = 60

LOGIN_ACCOUNT_LIMIT = 5
LOGIN_SOURCE_LIMIT = 20
LOGIN_WINDOW_S = 15 * 60
LOGIN_LOCKOUT_S = 15 * 60

_TOKEN_SCOPE = "op-token-source"
_LOGIN_ACCOUNT_SCOPE = "op-login-account"
_LOGIN_SOURCE_SCOPE = "op-login-source"


def _account(username: str) -> str:
    return username.strip().casefold()[:150]


# ---------------------------------------------------------------------- bearer tokens
def token_auth_retry_after(*, source: str) -> int | None:
    """Seconds until ``source`` may present tokens again; ``None`` when it may now."""
    return throttle_retry_after(scope=_TOKEN_SCOPE, key=source_bucket(source))


def token_auth_failed(*, source: str, presented: str, target: str, reason: str) -> None:
    """Count a bad or malformed token from ``source`` (``presented``: its visible prefix or ``?``)."""
    throttle_failure(scope=_TOKEN_SCOPE, key=source_bucket(source), limit=TOKEN_FAILURE_LIMIT,
                     window_s=TOKEN_WINDOW_S, lockout_s=TOKEN_LOCKOUT_S)
    audit_failure_record(action="auth.failed", kind="token", source=source, actor=presented, auth_method="token",
                         target=target, reason=reason)


def token_auth_refused(*, source: str, target: str) -> None:
    """Record a request refused (429) because ``source`` is locked."""
    audit_failure_record(action="auth.throttled", kind="token", source=source, actor="anonymous",
                         auth_method="token", target=target, reason="too many bad tokens from this source")


# ---------------------------------------------------------------------- password logins
def login_retry_after(*, username: str, source: str) -> int | None:
    """Seconds until ``username`` may try to log in from ``source``; ``None`` when it may now."""
    waits = [throttle_retry_after(scope=_LOGIN_ACCOUNT_SCOPE, key=_account(username)) if username else None,
             throttle_retry_after(scope=_LOGIN_SOURCE_SCOPE, key=source_bucket(source))]
    waits = [wait for wait in waits if wait is not None]
    return max(waits) if waits else None


def login_failed(*, username: str, source: str, via: str, reason: str) -> None:
    """Count a failed login of ``username`` from ``source`` through ``via`` (``ui`` / ``admin``)."""
    for scope, key, limit in ((_LOGIN_ACCOUNT_SCOPE, _account(username), LOGIN_ACCOUNT_LIMIT),
                              (_LOGIN_SOURCE_SCOPE, source_bucket(source), LOGIN_SOURCE_LIMIT)):
        throttle_failure(scope=scope, key=key, limit=limit, window_s=LOGIN_WINDOW_S, lockout_s=LOGIN_LOCKOUT_S)
    account = username.strip()[:150]
    audit_failure_record(action="auth.failed", kind="login", source=source, subject=_account(username),
                         actor=account or "anonymous", auth_method="password", target=f"login:{via}",
                         reason=reason, detail={"account": account})


def login_refused(*, username: str, source: str, via: str) -> None:
    """Record a login refused (lockout page) without checking its password."""
    account = username.strip()[:150]
    audit_failure_record(action="auth.throttled", kind="login", source=source, subject=_account(username),
                         actor=account or "anonymous", auth_method="password", target=f"login:{via}",
                         reason="too many failed logins for this account or source", detail={"account": account})


def login_succeeded(*, username: str, source: str, via: str) -> AuditEvent:
    """Record a successful login (an ``auth.login`` event) and clear the account's failures."""
    throttle_clear(scope=_LOGIN_ACCOUNT_SCOPE, key=_account(username))
    return audit_record(actor=username[:150], auth_method="password", source=source, action="auth.login",
                        target=f"login:{via}")

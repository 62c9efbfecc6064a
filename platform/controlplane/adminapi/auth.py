"""Who is calling the admin API, and may they do this?

Accepted credentials, in order:

1. ``Authorization: Bearer <operator token>`` (role from the token). A header that is present but
   malformed or wrong is a 401 even if a session cookie is also sent; a token that was revoked or
   has expired is a 401 ``token_revoked`` / ``token_expired``.
2. A logged-in Django session of a staff user (superuser = admin, other staff = viewer). CSRF is
   enforced for unsafe methods (403 ``csrf_failed``).

Viewers may use safe methods only (403 otherwise). Viewer write attempts are audited
(``auth.denied``); CSRF failures too, aggregated (``auth.failed``, one event per account and source
per minute: another site can make an operator's browser send them). Bad or malformed bearer
tokens are throttled per source and audited as aggregated ``auth.failed`` events
(``operators.authguard``): past the limit the source's failures get 429 with ``Retry-After``
(malformed ones without any lookup), while a valid token from that source is still served: only
failures are throttled. Sources come from ``common.sources`` (trusted proxies only). Requests that
bring no credentials at all are answered 401 without an event, so anonymous noise cannot flood the
log.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.http import HttpRequest
from django.utils import timezone
from ninja.security import HttpBearer
from ninja.utils import check_csrf

from controlplane.audit.aggregate import audit_failure_record
from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import Forbidden, RateLimited, Unauthenticated
from controlplane.common.sources import request_source
from controlplane.common.tokens import secret_prefix
from controlplane.operators.authguard import (
    token_auth_failed,
    token_auth_refused,
    token_auth_retry_after,
    token_well_formed,
)
from controlplane.operators.models import OperatorToken
from controlplane.operators.selectors import operator_token_match
from controlplane.operators.services import operator_token_mark_used

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TOKEN_KIND = "st-op-"


@dataclass(frozen=True)
class Principal:
    actor: Actor
    role: str  # "admin" | "viewer"

    @property
    def is_admin(self) -> bool:
        return self.role == OperatorToken.Role.ADMIN


def _audit_failure(request: HttpRequest, action: str, name: str, method: str, reason: str) -> None:
    audit_record(
        actor=Actor.at(name, method, request_source(request)), action=action,
        target=f"{request.method} {request.path}", reason=reason, result="denied",
    )


class OperatorAuth(HttpBearer):
    """ninja auth callable; returns a :class:`Principal` or ``None`` (-> 401)."""

    def __call__(self, request: HttpRequest) -> Principal | None:
        header = request.headers.get("Authorization")
        if header is not None:
            principal = self._from_header(request, header)
        else:
            principal = self._from_session(request)
        if principal is None:
            return None
        if not principal.is_admin and request.method not in SAFE_METHODS:
            _audit_failure(request, "auth.denied", principal.actor.name, principal.actor.auth_method,
                           f"role {principal.role} may only read")
            raise Forbidden(f"role {principal.role!r} may only read", code="read_only_role")
        return principal

    def authenticate(self, request: HttpRequest, token: str) -> Principal | None:
        operator = operator_token_match(token)
        if operator is None:
            return None
        state = operator.state(timezone.now())
        if state != "live":
            request.strata_dead_token = state  # _from_header answers 401 token_<state> (or 429 when locked)
            return None
        operator_token_mark_used(token=operator)
        return Principal(Actor.at(operator.username, "token", request_source(request)), operator.role)

    def _from_header(self, request: HttpRequest, header: str) -> Principal | None:
        where, target = request_source(request), f"{request.method} {request.path}"
        retry_after = token_auth_retry_after(where=where)
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        malformed = scheme.lower() != "bearer" or not token
        # The credential is checked before the source's lock: a valid token is served whatever others
        # sent from that address. While locked, what cannot be a token is refused without a lookup.
        principal = None
        if not malformed and (retry_after is None or token_well_formed(token)):
            principal = self.authenticate(request, token)
        if principal is not None:
            return principal
        if retry_after is not None:
            token_auth_refused(where=where, target=target)
            raise RateLimited("too many failed authentication attempts from this address; retry later",
                              retry_after=retry_after, code="auth_throttled")
        if malformed:
            token_auth_failed(where=where, presented="anonymous", target=target,
                              reason="malformed Authorization header")
            return None
        shown = secret_prefix(token) if token.startswith(TOKEN_KIND) else "?"
        dead = getattr(request, "strata_dead_token", None)
        token_auth_failed(where=where, presented=f"token:{shown}", target=target,
                          reason=f"{dead} token" if dead else "unknown token")
        if dead:
            raise Unauthenticated(f"this operator token is {dead}; create a new one", code=f"token_{dead}",
                                  headers={"WWW-Authenticate": "Bearer"})
        return None

    def _from_session(self, request: HttpRequest) -> Principal | None:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated or not user.is_active or not user.is_staff:
            return None
        name = user.get_username()
        if request.method not in SAFE_METHODS and check_csrf(request) is not None:
            # Aggregated: any web page the operator visits can make their browser send these.
            where = request_source(request)
            audit_failure_record(action="auth.failed", kind="csrf", source=where.source, peer=where.peer,
                                 forwarded_for=where.forwarded_for, subject=name, actor=name, auth_method="session",
                                 target=f"{request.method} {request.path}", reason="CSRF check failed")
            raise Forbidden("CSRF check failed", code="csrf_failed")
        role = OperatorToken.Role.ADMIN if user.is_superuser else OperatorToken.Role.VIEWER
        return Principal(Actor.at(name, "session", request_source(request)), role)


def actor_of(request: HttpRequest) -> Actor:
    """The authenticated caller's :class:`Actor` (for passing to services)."""
    return request.auth.actor

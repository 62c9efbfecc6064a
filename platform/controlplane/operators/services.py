"""Operator token writes (audited; the token itself is returned once and never stored)."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import InvalidInput
from controlplane.common.tokens import new_secret
from controlplane.operators.models import OperatorToken

TOKEN_KIND = "st-op-"
MAX_EXPIRY_DAYS = 3650
LAST_USED_EVERY_S = 60  # last_used is written at most this often per token


def operator_token_create(*, actor: Actor, username: str, role: str,
                          expires_days: int | None = None) -> tuple[OperatorToken, str]:
    """New token for ``username`` with ``role`` (``admin``/``viewer``): ``(OperatorToken, raw)``.
    It expires ``expires_days`` (1..3650) after now, by default ``STRATA_OPERATOR_TOKEN_DAYS``."""
    username = (username or "").strip()
    if not username or len(username) > 150:
        raise InvalidInput("username must be 1-150 characters")
    if role not in OperatorToken.Role.values:
        raise InvalidInput(f"role must be one of {', '.join(OperatorToken.Role.values)}")
    days = settings.STRATA_OPERATOR_TOKEN_DAYS if expires_days is None else expires_days
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_EXPIRY_DAYS:
        raise InvalidInput(f"expires_days must be a whole number of days from 1 to {MAX_EXPIRY_DAYS}")
    secret = new_secret(TOKEN_KIND)
    with transaction.atomic():
        token = OperatorToken.objects.create(
            username=username, role=role, prefix=secret.prefix, token_hash=secret.digest,
            expires_at=timezone.now() + timedelta(days=days),
        )
        audit_record(
            actor=actor, action="operator_token.create", target=token.prefix,
            new={"id": token.pk, "username": username, "role": role, "prefix": token.prefix,
                 "expires_at": token.expires_at.isoformat(timespec="seconds")},
        )
    return token, secret.raw


def operator_token_revoke(*, actor: Actor, token: OperatorToken) -> OperatorToken:
    """Revoke now; revoking twice is a no-op."""
    with transaction.atomic():
        locked = OperatorToken.objects.select_for_update().get(pk=token.pk)
        if locked.revoked_at is None:
            locked.revoked_at = timezone.now()
            locked.save(update_fields=["revoked_at"])
            audit_record(
                actor=actor, action="operator_token.revoke", target=locked.prefix,
                new={"id": locked.pk, "username": locked.username, "prefix": locked.prefix},
            )
    return locked


def operator_token_mark_used(*, token: OperatorToken) -> None:
    """Record use; at most one write per minute per token (none while the row read says it is fresh)."""
    now = timezone.now()
    if token.last_used is not None and token.last_used >= now - timedelta(seconds=LAST_USED_EVERY_S):
        return
    stale = Q(last_used__isnull=True) | Q(last_used__lt=now - timedelta(seconds=LAST_USED_EVERY_S))
    OperatorToken.objects.filter(stale, pk=token.pk).update(last_used=now)

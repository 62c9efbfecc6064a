"""Operator token writes (audited; the token itself is returned once and never stored)."""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import InvalidInput
from controlplane.common.tokens import new_secret
from controlplane.operators.models import OperatorToken

TOKEN_KIND = "st-op-"


def operator_token_create(*, actor: Actor, username: str, role: str) -> tuple[OperatorToken, str]:
    """New token for ``username`` with ``role`` (``admin``/``viewer``): ``(OperatorToken, raw)``."""
    username = (username or "").strip()
    if not username or len(username) > 150:
        raise InvalidInput("username must be 1-150 characters")
    if role not in OperatorToken.Role.values:
        raise InvalidInput(f"role must be one of {', '.join(OperatorToken.Role.values)}")
    secret = new_secret(TOKEN_KIND)
    with transaction.atomic():
        token = OperatorToken.objects.create(
            username=username, role=role, prefix=secret.prefix, token_hash=secret.digest
        )
        audit_record(
            actor=actor, action="operator_token.create", target=token.prefix,
            new={"id": token.pk, "username": username, "role": role, "prefix": token.prefix},
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
    """Record use; at most one write per minute per token."""
    now = timezone.now()
    stale = Q(last_used__isnull=True) | Q(last_used__lt=now - timedelta(seconds=60))
    OperatorToken.objects.filter(stale, pk=token.pk).update(last_used=now)

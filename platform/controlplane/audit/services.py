"""Audit writes. ``audit_record`` is the only way rows enter the log.

Appends are serialised by locking the chain head row (``SELECT ... FOR UPDATE`` on PostgreSQL; on
SQLite the connection's IMMEDIATE transactions hold the database write lock), so concurrent appends
from web, Celery and CLI processes always extend one unbroken chain. Call it inside the caller's
``transaction.atomic`` block: the event then commits or rolls back together with the change it
describes.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.audit.chain import canonical_json, event_hash
from controlplane.audit.models import GENESIS_HASH, AuditEvent, AuditHead
from controlplane.common.actor import Actor

# Keys that must never appear in old/new values: secrets and prompt text (DESIGN section 4).
FORBIDDEN_KEYS = frozenset({
    "key", "raw_key", "api_key", "token", "raw_token", "secret", "password", "salt", "scope_salt",
    "key_hash", "token_hash", "prompt", "messages",
})


class AuditSecretError(ValueError):
    """A caller tried to put a secret-looking field into an audit value (a programming error)."""


def _check_clean(value: Any, path: str = "") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if str(key).lower() in FORBIDDEN_KEYS:
                raise AuditSecretError(f"audit values must not carry {path}{key!s}")
            _check_clean(item, f"{path}{key}.")
    elif isinstance(value, list | tuple):
        for item in value:
            _check_clean(item, path)
    elif isinstance(value, bytes | bytearray | memoryview):
        raise AuditSecretError(f"audit values must not carry raw bytes ({path.rstrip('.') or 'value'})")


def _lock_head() -> AuditHead:
    head = AuditHead.objects.select_for_update().filter(pk=1).first()
    if head is not None:
        return head
    # First append (or after a test flush): seed the head from whatever the log already holds.
    last = AuditEvent.objects.order_by("-seq").first()
    try:
        with transaction.atomic():
            AuditHead.objects.create(
                pk=1, seq=last.seq if last else 0, hash=last.hash if last else GENESIS_HASH
            )
    except IntegrityError:
        pass  # a concurrent first append created it; lock theirs
    return AuditHead.objects.select_for_update().get(pk=1)


def audit_record(
    *,
    actor: Actor | str,
    action: str,
    target: str = "",
    tenant: str = "",
    old: Any = None,
    new: Any = None,
    reason: str = "",
    result: str = "ok",
    auth_method: str | None = None,
    source: str | None = None,
) -> AuditEvent:
    """Append one event and return it.

    ``actor`` is an :class:`Actor` (its ``auth_method``/``source`` are used unless given here) or a
    plain name with ``auth_method``/``source`` passed explicitly. ``action`` is ``<entity>.<verb>``
    (``tenant.create``, ``key.revoke``, ``auth.failed``...), ``target`` what it acted on (a slug, a
    key prefix), ``tenant`` the tenant slug it concerns (for filtering). ``old``/``new`` are JSON
    values; secret-looking keys or raw bytes raise :class:`AuditSecretError`. ``result`` is ``ok``,
    ``denied`` or ``error``.
    """
    if isinstance(actor, Actor):
        name = actor.name
        auth_method = actor.auth_method if auth_method is None else auth_method
        source = actor.source if source is None else source
    else:
        name = actor
    _check_clean(old)
    _check_clean(new)
    with transaction.atomic():
        head = _lock_head()
        event = AuditEvent(
            seq=head.seq + 1,
            time=timezone.now(),
            actor=name[:150],
            auth_method=(auth_method or "")[:16],
            source=(source or "")[:64],
            action=action[:64],
            target=target[:255],
            tenant=tenant[:63],
            old=None if old is None else canonical_json(old),
            new=None if new is None else canonical_json(new),
            reason=reason,
            result=result[:16],
            prev_hash=head.hash,
        )
        event.hash = event_hash(event)
        event.save(force_insert=True)
        AuditHead.objects.filter(pk=1).update(seq=event.seq, hash=event.hash)
    return event

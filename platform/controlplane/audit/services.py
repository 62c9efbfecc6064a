"""Audit writes. ``audit_record`` is the only way rows enter the log.

Appends are serialised by locking the chain head row (``SELECT ... FOR UPDATE`` on PostgreSQL; on
SQLite the connection's IMMEDIATE transactions hold the database write lock), so concurrent appends
from web, Celery and CLI processes always extend one unbroken chain. Call it inside the caller's
``transaction.atomic`` block: the event then commits or rolls back together with the change it
describes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from django.db import DatabaseError, transaction
from django.utils import timezone

from controlplane.audit.chain import canonical_json, event_hash
from controlplane.audit.headlog import head_log_append_quietly
from controlplane.audit.models import GENESIS_HASH, AuditEvent, AuditHead
from controlplane.common.actor import Actor

# Keys that must never appear in old/new values: secrets and prompt text (docs/design.md section 4).
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


def _lock_head() -> tuple[AuditHead, AuditEvent | None]:
    """The locked head, and the last event when the head row had to be re-created even though the
    log holds events (the row was removed behind the triggers' back)."""
    head = AuditHead.objects.select_for_update().filter(pk=1).first()
    if head is not None:
        return head, None
    # First append (or after a test flush): seed the head from whatever the log already holds.
    last = AuditEvent.objects.order_by("-seq").first()
    try:
        with transaction.atomic():
            AuditHead.objects.create(
                pk=1, seq=last.seq if last else 0, hash=last.hash if last else GENESIS_HASH
            )
    except DatabaseError:
        last = None  # a concurrent first append created it (IntegrityError, or a trigger); lock theirs
    return AuditHead.objects.select_for_update().get(pk=1), last


def _append(head: AuditHead, *, name: str, auth_method: str, source: str, action: str, target: str,
            tenant: str, old: Any, new: Any, reason: str, result: str, peer: str = "",
            forwarded_for: str = "") -> AuditEvent:
    event = AuditEvent(
        seq=head.seq + 1,
        time=timezone.now(),
        actor=name[:150],
        auth_method=auth_method[:16],
        source=source[:64],
        peer=peer[:64],
        forwarded_for=forwarded_for[:255],
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
    head.seq, head.hash = event.seq, event.hash
    # Outside the database, once committed: a rollback must not advance the external head.
    transaction.on_commit(partial(head_log_append_quietly, seq=event.seq, hash=event.hash))
    return event


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
    peer: str | None = None,
    forwarded_for: str | None = None,
) -> AuditEvent:
    """Append one event and return it.

    ``actor`` is an :class:`Actor` (its ``auth_method``/``source`` are used unless given here) or a
    plain name with ``auth_method``/``source`` passed explicitly; ``peer``/``forwarded_for`` (the TCP
    peer and the ``X-Forwarded-For`` chain ``source`` was derived from) likewise. ``action`` is ``<entity>.<verb>``
    (``tenant.create``, ``key.revoke``, ``auth.failed``...), ``target`` what it acted on (a slug, a
    key prefix), ``tenant`` the tenant slug it concerns (for filtering). ``old``/``new`` are JSON
    values; secret-looking keys or raw bytes raise :class:`AuditSecretError`. ``result`` is ``ok``,
    ``denied`` or ``error``.

    If the head row is missing while events exist (removed behind the triggers' back), it is
    re-created from the last event and an ``audit.head_restored`` event is appended first, so the
    incident stays in the chain. After commit the new head is appended to the external head log.
    """
    if isinstance(actor, Actor):
        name = actor.name
        auth_method = actor.auth_method if auth_method is None else auth_method
        source = actor.source if source is None else source
        peer = actor.peer if peer is None else peer
        forwarded_for = actor.forwarded_for if forwarded_for is None else forwarded_for
    else:
        name = actor
    _check_clean(old)
    _check_clean(new)
    with transaction.atomic():
        head, restored_from = _lock_head()
        if restored_from is not None:
            _append(head, name="system:audit", auth_method="system", source="", action="audit.head_restored",
                    target=f"seq {restored_from.seq}", tenant="", old=None,
                    new={"seq": restored_from.seq, "hash": restored_from.hash},
                    reason="the chain head record was missing; re-created from the last event", result="error")
        return _append(head, name=name, auth_method=auth_method or "", source=source or "", action=action,
                       target=target, tenant=tenant, old=old, new=new, reason=reason, result=result,
                       peer=peer or "", forwarded_for=forwarded_for or "")

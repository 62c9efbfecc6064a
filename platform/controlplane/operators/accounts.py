"""Operator accounts' privileges: the Django user flags that make an operator (``is_staff``: viewer,
``is_superuser``: admin, ``is_active``). Changed only here, audited in the same transaction."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

from django.contrib.auth import get_user_model
from django.db import transaction

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor

FLAGS = ("is_staff", "is_superuser", "is_active")
_audited: ContextVar[bool] = ContextVar("strata_user_privileges_audited", default=False)


def privileges_audited_here() -> bool:
    """True while ``user_privileges_set`` saves (the signal backstop then stays quiet)."""
    return _audited.get()


def audited_save():
    """``with audited_save():`` around a user save whose caller records its own, attributed audit
    event (the signal backstop then stays quiet)."""
    return _audited_save()


@contextmanager
def _audited_save():
    token = _audited.set(True)
    try:
        yield
    finally:
        _audited.reset(token)


def user_privileges_set(
    *,
    actor: Actor,
    user,
    is_staff: bool | None = None,
    is_superuser: bool | None = None,
    is_active: bool | None = None,
    reason: str = "",
):
    """Set the given flags of ``user``; one ``user.privileges`` event with old and new values when
    anything changes (nothing is written otherwise). Returns the user."""
    wanted = {"is_staff": is_staff, "is_superuser": is_superuser, "is_active": is_active}
    with transaction.atomic():
        locked = get_user_model().objects.select_for_update().get(pk=user.pk)
        old = {flag: getattr(locked, flag) for flag in FLAGS}
        new = {**old, **{flag: bool(value) for flag, value in wanted.items() if value is not None}}
        if new != old:
            for flag in FLAGS:
                setattr(locked, flag, new[flag])
            with _audited_save():
                locked.save(update_fields=list(FLAGS))
            audit_record(actor=actor, action="user.privileges", target=locked.get_username(), old=old, new=new,
                         reason=reason)
    return locked

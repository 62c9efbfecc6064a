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


ROLES = ("admin", "viewer")  # a console user's role: admin = superuser, viewer = staff only


def role_of(user) -> str:
    return "admin" if user.is_superuser else "viewer"


def console_user_create(*, actor: Actor, username: str, password: str, role: str, reason: str = ""):
    """A new console login (staff; ``admin``: superuser too), audited ``user.create`` with the actor.
    422 for a name or password Django's validators refuse, 409 for a name in use."""
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError

    from controlplane.common.errors import Conflict, InvalidInput

    users = get_user_model()
    if role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}", code="invalid_role")
    username = (username or "").strip()
    try:
        users.username_validator(username)
        if not username:
            raise ValidationError("a username is required")
        validate_password(password, users(username=username))
    except ValidationError as exc:
        raise InvalidInput(" ".join(exc.messages), code="invalid_user") from None
    with transaction.atomic():
        if users.objects.filter(username=username).exists():
            raise Conflict(f"user '{username}' exists", code="user_exists")
        with _audited_save():
            user = users.objects.create_user(username=username, password=password, is_staff=True,
                                             is_superuser=role == "admin")
        audit_record(actor=actor, action="user.create", target=username, new={"role": role, "is_staff": True},
                     reason=reason)
    return user


def console_user_set(*, actor: Actor, user, active: bool | None = None, role: str | None = None, reason: str = ""):
    """Disable or enable a console login, or change its role (``user_privileges_set``, audited). The
    last active admin can be neither disabled nor demoted (409): the console would lose its admins."""
    from controlplane.common.errors import Conflict, InvalidInput

    if role is not None and role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}", code="invalid_role")
    losing_admin = user.is_superuser and user.is_active and (active is False or role == "viewer")
    if losing_admin:
        admins = get_user_model().objects.filter(is_superuser=True, is_active=True, is_staff=True)
        if not admins.exclude(pk=user.pk).exists():
            raise Conflict("this is the last active admin: make another admin first", code="last_admin")
    return user_privileges_set(actor=actor, user=user, is_active=active,
                               is_superuser=None if role is None else role == "admin", reason=reason)

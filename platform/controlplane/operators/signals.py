"""Backstop: a Django user's ``is_staff`` / ``is_superuser`` / ``is_active`` never change without an
audit event, whatever saves the user (the admin site, a shell, ``createsuperuser``).

``pre_save`` reads the stored flags; ``post_save`` appends ``user.privileges`` (a change) or
``user.create`` (a new user with any privilege) in the same transaction as the save, with actor
``system:unattributed`` because no request is known here. ``accounts.user_privileges_set`` records
its own, attributed event, so its saves are skipped. Saves that name ``update_fields`` without a
flag (``last_login`` on every login) cost no query.
"""

from __future__ import annotations

from controlplane.audit.services import audit_record
from controlplane.operators.accounts import FLAGS, privileges_audited_here

_STASH = "_strata_stored_flags"


def remember_flags(sender, instance, raw=False, update_fields=None, **kwargs) -> None:
    if raw or privileges_audited_here():
        return
    if update_fields is not None and not set(update_fields) & set(FLAGS):
        return
    stored = None
    if instance.pk is not None:
        stored = sender._default_manager.filter(pk=instance.pk).values(*FLAGS).first()
    setattr(instance, _STASH, stored)


def audit_flag_change(sender, instance, created=False, raw=False, **kwargs) -> None:
    if raw or not hasattr(instance, _STASH):
        return
    stored = getattr(instance, _STASH)
    delattr(instance, _STASH)
    current = {flag: bool(getattr(instance, flag)) for flag in FLAGS}
    if stored is None:
        if created and (current["is_staff"] or current["is_superuser"]):
            audit_record(actor="system:unattributed", auth_method="system", source="", action="user.create",
                         target=instance.get_username(), new=current,
                         reason="user created with privileges outside an audited service")
        return
    if current != stored:
        audit_record(actor="system:unattributed", auth_method="system", source="", action="user.privileges",
                     target=instance.get_username(), old=stored, new=current,
                     reason="privileges changed outside an audited service")

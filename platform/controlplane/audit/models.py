"""AuditEvent rows are written once by ``services.audit_record`` and never changed.

The database refuses UPDATE and DELETE on ``audit_auditevent`` (triggers installed by migrations 0002
and 0003, see ``triggers.py``); the keyed hash chain (``chain.py``) detects what a privileged user
does behind the triggers' back. ``AuditHead`` is the one-row lock that serialises appends and
remembers the last seq/hash (the database lets it move forward only), so a truncated tail is
detected too; the external head log (``headlog.py``) catches a tail truncated with the head
rewound to match.
"""

from __future__ import annotations

import json

from django.db import models

GENESIS_HASH = "0" * 64


class AuditEvent(models.Model):
    seq = models.BigIntegerField(primary_key=True)
    time = models.DateTimeField(db_index=True)
    actor = models.CharField(max_length=150, db_index=True)
    auth_method = models.CharField(max_length=16)
    source = models.CharField(max_length=64, blank=True)
    # How ``source`` was derived (common.sources): the TCP peer and the X-Forwarded-For chain as
    # received. Nullable so adding them is a plain ADD COLUMN (SQLite would otherwise rebuild the
    # table and lose its append-only triggers); NULL and "" are left out of the hash (chain.py).
    peer = models.CharField(max_length=64, null=True, blank=True)  # noqa: DJ001
    forwarded_for = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    action = models.CharField(max_length=64, db_index=True)
    target = models.CharField(max_length=255, blank=True)
    tenant = models.CharField(max_length=63, blank=True, db_index=True)
    # Canonical JSON text (sorted keys): stored exactly as hashed, so no database JSON type can
    # re-normalise it and break the chain.
    old = models.TextField(null=True)
    new = models.TextField(null=True)
    reason = models.TextField(blank=True)
    result = models.CharField(max_length=16, default="ok")
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64, unique=True)

    class Meta:
        ordering = ["seq"]

    def __str__(self) -> str:
        return f"#{self.seq} {self.action} {self.target} by {self.actor}"

    @property
    def old_value(self):
        return None if self.old is None else json.loads(self.old)

    @property
    def new_value(self):
        return None if self.new is None else json.loads(self.new)


class AuditHead(models.Model):
    """Single row (pk=1): the chain head. Locked (SELECT ... FOR UPDATE) by every append."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    seq = models.BigIntegerField(default=0)
    hash = models.CharField(max_length=64, default=GENESIS_HASH)

    def __str__(self) -> str:
        return f"head #{self.seq}"


class AuditCheck(models.Model):
    """Single row (pk=1): the chain's last scheduled verification, what ``/metrics`` reports
    (``strata_audit_verify_*``) so that an alert fires when the chain stops verifying.

    ``claimed_at`` is when a process last claimed a run (``services.audit_check_claim``: one claim
    per interval across every process); ``checked_at`` and the result are those of the last run that
    finished; ``failures`` counts the runs that found the chain broken, ever (it only grows)."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    claimed_at = models.DateTimeField(null=True, blank=True)
    checked_at = models.DateTimeField(null=True, blank=True)
    ok = models.BooleanField(default=False)
    length = models.BigIntegerField(default=0)  # events the run read
    first_bad = models.BigIntegerField(null=True, blank=True)
    problem = models.TextField(blank=True)
    failures = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"audit check at {self.checked_at}: {'ok' if self.ok else self.problem or 'not run'}"

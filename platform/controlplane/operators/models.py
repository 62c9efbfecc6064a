"""Operator tokens: like tenant keys, stored as visible prefix + SHA-256 of the whole token."""

from django.db import models


class OperatorToken(models.Model):
    class Role(models.TextChoices):
        ADMIN = "admin"  # may read and change everything
        VIEWER = "viewer"  # may read (GET) only

    username = models.CharField(max_length=150)
    role = models.CharField(max_length=16, choices=Role.choices)
    prefix = models.CharField(max_length=16, db_index=True)
    token_hash = models.CharField(max_length=64, unique=True)
    created = models.DateTimeField(auto_now_add=True)
    last_used = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)  # None: never (tokens made before expiry existed)

    class Meta:
        ordering = ["id"]

    def state(self, now) -> str:
        """``live``, ``revoked`` or ``expired`` at ``now`` (revocation wins: it was a decision)."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "live"

    def __str__(self) -> str:
        return f"{self.username} ({self.role}, {self.prefix}…)"

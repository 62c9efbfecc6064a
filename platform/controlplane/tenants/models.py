"""Tenant state. Scope salts are secret (32 random bytes) and never leave the server: APIs, pages and
audit show only ``selectors.tenant_scope_fingerprint``."""

from __future__ import annotations

import secrets

from django.core.validators import RegexValidator
from django.db import models

SLUG_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
slug_validator = RegexValidator(SLUG_PATTERN, "use 1-63 characters a-z, 0-9 and '-' (not at either end)")
QUOTA_FIELDS = (
    "requests_per_minute", "tokens_per_minute", "max_cached_tokens", "max_prompt_tokens", "max_l3_bytes",
    "max_inflight_tokens", "max_concurrent_requests",
)


def new_scope_salt() -> bytes:
    return secrets.token_bytes(32)


class ShareGroup(models.Model):
    """Tenants explicitly put in one group share a scope salt, hence cache entries."""

    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    scope_salt = models.BinaryField(default=new_scope_salt, editable=False)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


class Tenant(models.Model):
    class Status(models.TextChoices):
        ACTIVE = "active"
        SUSPENDED = "suspended"
        OFFBOARDED = "offboarded"

    slug = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    scope_salt = models.BinaryField(default=new_scope_salt, editable=False)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    share_group = models.ForeignKey(
        ShareGroup, null=True, blank=True, on_delete=models.PROTECT, related_name="members"
    )
    # Quotas: NULL = unlimited. Enforced by the serving API.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveBigIntegerField(null=True, blank=True)
    max_cached_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    max_prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    max_l3_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    # Resource bounds per worker; NULL = the worker's safe default (half the pool; a quarter of its
    # request slots), never unlimited.
    max_inflight_tokens = models.PositiveBigIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def quotas(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in QUOTA_FIELDS}

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE


class ApiKey(models.Model):
    """A tenant's bearer key: visible prefix + SHA-256 of the whole key (the key is shown once)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    created = models.DateTimeField(auto_now_add=True)
    last_used = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant_id})"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class Grant(models.Model):
    """Tenant may use a model deployment. No grant = the model does not exist for that tenant."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="grants")
    deployment = models.ForeignKey("registry.ModelDeployment", on_delete=models.CASCADE, related_name="grants")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["tenant", "deployment"], name="grant_unique_tenant_model")]

    def __str__(self) -> str:
        return f"{self.tenant_id} -> {self.deployment_id}"

"""Tenant state. Scope salts are secret (32 random bytes) and never leave the server: APIs, pages and
audit show only ``selectors.tenant_scope_fingerprint``. Data keys (L3 encryption) are stored only
wrapped by the master key and never leave the server except to the cache workers."""

from __future__ import annotations

import secrets

from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q

from controlplane.tenants import quotas as quota_registry
from controlplane.tenants.quotas import QuotaSpec

SLUG_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
slug_validator = RegexValidator(SLUG_PATTERN, "use 1-63 characters a-z, 0-9 and '-' (not at either end)")
INT_COLUMNS = {16: models.PositiveSmallIntegerField, 32: models.PositiveIntegerField,
               64: models.PositiveBigIntegerField}


RETENTION_DEFAULT_SECONDS = 86_400  # 24 h
RETENTION_MAX_SECONDS = 31_536_000  # 365 days


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


def quota_column(spec: QuotaSpec) -> models.Field:
    """A quota's column: nullable (null = unlimited or the worker's default, ``spec.null_means``), as
    wide as ``spec.bits`` for an int. Bounds are checked by ``quotas.clean``, not by the column."""
    if spec.value_type is float:
        return models.FloatField(null=True, blank=True)
    return INT_COLUMNS[spec.bits](null=True, blank=True)


def _quota_columns() -> type[models.Model]:
    """An abstract model with one column per quota of the registry (``quota_registry.QUOTAS``)."""
    meta = type("Meta", (), {"abstract": True})
    columns = {spec.name: quota_column(spec) for spec in quota_registry.QUOTAS}
    return type("QuotaColumns", (models.Model,), {"__module__": __name__, "Meta": meta, **columns})


QuotaColumns = _quota_columns()


class Tenant(QuotaColumns):
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
    # Quotas: one column each, from ``QuotaColumns`` (the registry, ``controlplane.tenants.quotas``).
    # Cache policy: may this tenant's KV be persisted beyond host memory (L3), and for how long.
    persist_kv = models.BooleanField(default=True)
    retention_seconds = models.PositiveIntegerField(default=RETENTION_DEFAULT_SECONDS)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(condition=Q(retention_seconds__lte=RETENTION_MAX_SECONDS),
                                   name="tenant_retention_at_most_a_year"),
        ]

    def __str__(self) -> str:
        return self.slug

    @property
    def quotas(self) -> dict[str, int | float | None]:
        """Every quota by name, in registry order (the admin API's ``quotas``)."""
        return quota_registry.of(self)

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE

    @property
    def cache_policy(self) -> dict[str, bool | int]:
        """The admin API's shape: ``{"persist", "retention_seconds"}``."""
        return {"persist": self.persist_kv, "retention_seconds": self.retention_seconds}


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


class DataKey(models.Model):
    """One version of a tenant's L3 data key: 32 random bytes, stored only wrapped by the master key
    (AES-256-GCM, ``cachecore.crypto.wrap_key`` bound to the tenant id and version).

    ``active``: new L3 objects are encrypted with it (at most one per tenant, enforced by the
    database; the services keep exactly one for every tenant that has keys and is not offboarded).
    ``retired``: replaced by a rotation, still readable. ``shredded``: the wrapped key is gone
    (``wrapped`` NULL), so no process can unwrap it any more, whoever holds the master key and the
    database. Versions are never reused."""

    class State(models.TextChoices):
        ACTIVE = "active"
        RETIRED = "retired"
        SHREDDED = "shredded"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="data_keys")
    version = models.PositiveIntegerField()
    wrapped = models.BinaryField(null=True, editable=False)
    state = models.CharField(max_length=16, choices=State.choices, default=State.ACTIVE)
    created = models.DateTimeField(auto_now_add=True)
    retired_at = models.DateTimeField(null=True, blank=True)
    shredded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["tenant_id", "version"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "version"], name="datakey_unique_tenant_version"),
            models.UniqueConstraint(fields=["tenant"], condition=Q(state="active"),
                                    name="datakey_one_active_per_tenant"),
            models.CheckConstraint(condition=Q(version__gte=1), name="datakey_version_from_one"),
            # shredded <=> no wrapped key
            models.CheckConstraint(
                condition=(Q(state="shredded") & Q(wrapped__isnull=True))
                | (~Q(state="shredded") & Q(wrapped__isnull=False)),
                name="datakey_shredded_has_no_key",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} v{self.version} ({self.state})"

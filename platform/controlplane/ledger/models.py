"""One row per (tenant, model, hour): the counters of every request the tenant finished for that
model in that hour, plus the L3 storage the stats sampler saw it hold.

Counters (``services.ledger_record``, one call per finished request, prewarms included):
``requests``; ``prompt_tokens`` (presented to the cache), ``completion_tokens``, ``cached_tokens``
(prompt tokens whose prefill was skipped) split by the tier they were read from (``cached_l1``,
``cached_l2``, ``cached_l3``), ``write_tokens`` (prompt tokens the request added to the cache), and
per miss reason the prompt tokens lost for it (one column each, ``miss_<reason>``, so that every
increment is a plain ``F()`` update: no read-modify-write of a JSON document, no lost update).
Reasons not in :data:`MISS_REASONS` are counted in ``miss_other``.

Storage: ``l3_byte_seconds`` (``services.ledger_accrue_sample``: a tenant's L3 bytes x the sampling
interval, on the row of model :data:`ALL_MODELS`, because the L3 store is shared by every
deployment and counts bytes per tenant only). Pinned token-seconds are not stored: the selectors
compute them exactly from the ``caches.NamedCache`` rows (which are soft-deleted, never removed).

Rows are never deleted; an offboarded tenant keeps its ledger (the tenant row is never deleted
either: ``PROTECT``).
"""

from __future__ import annotations

from django.db import models

MISS_REASONS = ("no_prior_request", "diverged", "evicted", "expired", "flushed", "revision_changed",
                "routed_elsewhere", "load_failed", "too_slow_to_load", "below_block", "deleted")
OTHER_REASON = "other"
REASON_ALIASES = {"diverged_at": "diverged"}  # the diagnostics' span name for a divergence
ALL_MODELS = "*"  # the model of the L3 storage rows (see the module docstring)

TOKEN_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "cached_l1", "cached_l2", "cached_l3",
                "write_tokens")
COUNTER_FIELDS = ("requests", *TOKEN_FIELDS)
STORAGE_FIELDS = ("l3_byte_seconds",)


def miss_field(reason: str) -> str:
    return f"miss_{reason}"


MISS_FIELDS = tuple(miss_field(r) for r in (*MISS_REASONS, OTHER_REASON))
SUM_FIELDS = (*COUNTER_FIELDS, *STORAGE_FIELDS, *MISS_FIELDS)  # every additive column


def _counter() -> models.PositiveBigIntegerField:
    return models.PositiveBigIntegerField(default=0)


class LedgerHour(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="ledger_hours")
    model = models.CharField(max_length=100)  # the deployment's name (ALL_MODELS for L3 storage)
    hour = models.DateTimeField()  # aware, floored to the hour (UTC)

    requests = _counter()
    prompt_tokens = _counter()
    completion_tokens = _counter()
    cached_tokens = _counter()
    cached_l1 = _counter()
    cached_l2 = _counter()
    cached_l3 = _counter()
    write_tokens = _counter()
    l3_byte_seconds = _counter()

    miss_no_prior_request = _counter()
    miss_diverged = _counter()
    miss_evicted = _counter()
    miss_expired = _counter()
    miss_flushed = _counter()
    miss_revision_changed = _counter()
    miss_routed_elsewhere = _counter()
    miss_load_failed = _counter()
    miss_too_slow_to_load = _counter()
    miss_below_block = _counter()
    miss_deleted = _counter()
    miss_other = _counter()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "model", "hour"], name="ledger_hour_scope")]
        indexes = [models.Index(fields=["hour"], name="ledger_hour_time")]  # all-tenant period reads
        ordering = ["hour", "tenant", "model"]

    @property
    def misses(self) -> dict[str, int]:
        """``{reason: tokens}`` of the non-zero miss columns."""
        out = {r: getattr(self, miss_field(r)) for r in (*MISS_REASONS, OTHER_REASON)}
        return {r: n for r, n in out.items() if n}

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.model} {self.hour:%Y-%m-%d %H}:00"


class LedgerSample(models.Model):
    """A sample time whose L3 storage was accrued: two samplers (two web processes) writing the same
    interval accrue it once. Kept a day (no sampler writes an interval that old)."""

    at = models.DateTimeField(unique=True)

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S}"

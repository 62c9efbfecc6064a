"""Adapter: a LoRA adapter (a PEFT directory) served on a base deployment, public or one tenant's.

``name`` is what a tenant sends as ``"model"``: unique among live adapters (and never a deployment's
name), so it names one adapter; a replaced adapter's old row is ``deleting`` beside its live successor
until its KV is gone (``adapters.services.adapter_replace``). ``digest`` (sha256 over the adapter's files) and the
row's id make its cache scope (``Adapter.scope``): a new registration of the same name, even with the
same files, is a new scope and never reaches KV cached for the old one. ``state``: ``live`` (served),
``deleting`` (an ``adapter_delete`` job is removing its KV: no longer served), ``deleted``.
"""

from __future__ import annotations

from django.db import models

from controlplane.registry.models import name_validator


class Adapter(models.Model):
    class State(models.TextChoices):
        LIVE = "live"
        DELETING = "deleting"
        DELETED = "deleted"

    name = models.CharField(max_length=100, validators=[name_validator])
    deployment = models.ForeignKey("registry.ModelDeployment", on_delete=models.CASCADE, related_name="adapters")
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE,
                               related_name="adapters")  # None: every tenant granted the base model
    path = models.CharField(max_length=1024)
    digest = models.CharField(max_length=64)
    rank = models.PositiveIntegerField()
    alpha = models.FloatField()
    target_modules = models.JSONField(default=list)
    dtype = models.CharField(max_length=16)
    state = models.CharField(max_length=16, choices=State.choices, default=State.LIVE, db_index=True)
    created = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["deployment_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["name"], condition=models.Q(state="live"),
                                    name="adapter_unique_live_name"),
        ]

    def __str__(self) -> str:
        return f"{self.name}@{self.deployment_id}"

    @property
    def scope(self) -> str:
        """The adapter's part of every cache key (the namespace's ``lora_id``) and of its L2/L3 tags."""
        return f"lora{self.pk}-{self.digest[:16]}"

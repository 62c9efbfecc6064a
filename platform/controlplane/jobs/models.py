"""FlushJob: one operator request (flush, rollout, offboard or shred) and everything that happened to it.

A ``shred`` job crypto-shreds one data-key version of its tenant (``key_version``); an ``offboard``
job flushes its tenant and shreds every one of its versions (steps inside that one job). The tenant's
cache policy queues the two L3-only jobs: ``l3_delete`` (persistence turned off: every L3 object of
the tenant is deleted on every replica; L1/L2 untouched) and ``l3_expire`` (retention lowered: every
replica applies the tenant's retention as it is when the job runs and deletes what is older).
Deleting a model queues a ``model_delete`` job (scope model: stop its requests, flush it everywhere,
stop every replica, delete its L3 objects, end its grants: ``jobs.deletes``); deleting an inactive
revision a ``revision_delete`` job (scope revision: its KV leaves every tier, L3 included).
``adapter_delete`` (scope model: the adapter's base deployment) removes one LoRA adapter's KV from
every tier of every replica and unloads it (``adapters.services.adapter_delete``).

Per-worker results live in ``results`` keyed by worker name, so a retried or resumed task skips the
workers already done (idempotent), and ``steps`` is the job's own history, shown in the UI and API.
"""

from __future__ import annotations

from django.db import models


class FlushJob(models.Model):
    class Kind(models.TextChoices):
        FLUSH = "flush"
        ROLLOUT = "rollout"
        OFFBOARD = "offboard"
        SHRED = "shred"
        L3_DELETE = "l3_delete"
        L3_EXPIRE = "l3_expire"
        MODEL_DELETE = "model_delete"
        REVISION_DELETE = "revision_delete"
        ADAPTER_DELETE = "adapter_delete"

    class Scope(models.TextChoices):
        TENANT = "tenant"
        MODEL = "model"
        REVISION = "revision"
        ALL = "all"

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        PARTIAL = "partial"
        FAILED = "failed"

    FINAL = (Status.SUCCEEDED, Status.PARTIAL, Status.FAILED)

    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.FLUSH)
    scope = models.CharField(max_length=16, choices=Scope.choices)
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.PROTECT)
    deployment = models.ForeignKey("registry.ModelDeployment", null=True, blank=True, on_delete=models.PROTECT)
    revision = models.ForeignKey("registry.ModelRevision", null=True, blank=True, on_delete=models.PROTECT,
                                 related_name="+")  # flush: the revision flushed; rollout: the new one
    from_revision = models.ForeignKey("registry.ModelRevision", null=True, blank=True, on_delete=models.PROTECT,
                                      related_name="+")  # rollout: the revision replaced
    adapter = models.ForeignKey("adapters.Adapter", null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="+")  # adapter_delete: the adapter whose KV goes
    key_version = models.PositiveIntegerField(null=True, blank=True)  # shred: the data-key version
    reason = models.TextField()
    requested_by = models.CharField(max_length=150)
    auth_method = models.CharField(max_length=16, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    progress_done = models.PositiveIntegerField(default=0)
    progress_total = models.PositiveIntegerField(default=0)
    results = models.JSONField(default=dict)  # worker name -> {"status", "blocks_freed", ...}
    steps = models.JSONField(default=list)  # [{"at", "step", "detail"}]
    verified = models.BooleanField(default=False)
    error = models.TextField(blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"job {self.pk} {self.kind}/{self.scope} {self.status}"

    @property
    def is_final(self) -> bool:
        return self.status in self.FINAL

"""``WeightHash``: a revision whose digest is being computed in the background (``hashing.services``).

The revision's own ``digest`` column stays ``""`` (pending) until the hash lands there; this row holds
what was validated (``plan``), the progress, the lease (``owner`` and ``heartbeat_at``: a row whose
heartbeat is older than ``STRATA_DIGEST_STALE_SECONDS`` is taken over) and, when the hash failed, the
reason (``state = failed``: the revision is never served). The row is removed once the digest is known.
"""

from __future__ import annotations

from django.db import models

from controlplane.registry.models import ModelRevision


class WeightHash(models.Model):
    class State(models.TextChoices):
        HASHING = "hashing", "hashing"
        FAILED = "failed", "failed"

    revision = models.OneToOneField(ModelRevision, on_delete=models.CASCADE, primary_key=True,
                                    related_name="weight_hash")
    plan = models.JSONField()  # hasher.Plan.to_json()
    state = models.CharField(max_length=16, choices=State.choices, default=State.HASHING)
    total_bytes = models.BigIntegerField(default=0)
    done_bytes = models.BigIntegerField(default=0)
    error = models.TextField(blank=True, default="")
    owner = models.CharField(max_length=100, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.revision_id}: {self.state} {self.done_bytes}/{self.total_bytes}"

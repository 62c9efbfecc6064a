"""One row per (sample time, scope, worker): the counters one worker reported for that scope.

A worker is one replica of a deployment: ``(model, replica)``.

Scopes: ``tenant`` (name = slug), ``model`` (name = deployment: the worker's totals and its
load-vs-recompute decisions) and ``tier`` (name = l1/l2/l3). ``model`` is the deployment whose worker
counted the row, so a worker restart (its counters back to zero) is detected and handled per worker;
the cluster total is the sum of the ``model`` rows' deltas (see ``selectors.series_for``).

``values`` maps a counter name to a number. Every value is a monotonic counter except the
:func:`is_gauge` ones (current levels: tier capacity/use, a tenant's resident bytes per tier).
"""

from __future__ import annotations

from django.db import models

GAUGES = frozenset({"capacity_blocks", "used_blocks", "capacity_bytes", "used_bytes"})
RESIDENT_PREFIX = "resident_bytes_"  # + tier name: a tenant's resident bytes in that tier


def is_gauge(key: str) -> bool:
    """True for a level (charted as is), False for a monotonic counter (charted as deltas)."""
    return key in GAUGES or key.startswith(RESIDENT_PREFIX)


class StatSample(models.Model):
    class Kind(models.TextChoices):
        TENANT = "tenant"
        MODEL = "model"
        TIER = "tier"

    at = models.DateTimeField()  # the sample's time, floored to the sampling interval
    kind = models.CharField(max_length=8, choices=Kind.choices)
    name = models.CharField(max_length=100)
    model = models.CharField(max_length=100)  # the deployment whose worker reported these counters
    replica = models.PositiveSmallIntegerField(default=0)  # which of the deployment's replicas
    values = models.JSONField(default=dict)

    class Meta:
        constraints = [
            # Two samplers (two web processes) writing one interval: the second one's rows are dropped.
            # Its index (leading ``at``) also serves the time-range reads and the pruning.
            models.UniqueConstraint(fields=["at", "kind", "name", "model", "replica"],
                                    name="timeseries_sample_scope"),
        ]
        ordering = ["at", "kind", "name", "model", "replica"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.kind}:{self.name}@{self.model}/{self.replica}"

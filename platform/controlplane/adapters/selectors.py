"""Adapter reads.

- ``adapter_list(deployment=...)``: the deployment's adapters that are not deleted.
- ``adapter_get(deployment=..., name=...)``: one of them; 404 ``adapter_not_found``.
- ``usable_for(tenant)``: every adapter ``tenant`` may use, by name, as ``AdapterRef`` (one query:
  admission reads it with the tenant's grants and keeps it while the access generation stands).
- ``usable(tenant, name)``: the ``AdapterRef`` of adapter ``name`` if ``tenant`` may use it, else None.
- ``adapters_by_deployment(deployments)``: the adapters (not deleted) of several deployments, by
  deployment id (one query: the console's models page).
- ``tenant_adapters(tenant)``: ``tenant``'s private adapters that are not deleted (its page).

A tenant may use an adapter that is live, on a deployment granted to the tenant with an active
revision, and public (no tenant) or the tenant's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Q, QuerySet

from controlplane.adapters.models import Adapter
from controlplane.common.errors import NotFound


@dataclass(frozen=True)
class AdapterRef:
    """What serving needs of an adapter: ``to_worker()`` is the worker request's ``lora``."""

    id: int
    name: str
    deployment_id: int
    deployment: str  # the base deployment's name (its ``"parent"`` in ``GET /v1/models``)
    tenant_id: int | None
    digest: str
    path: str
    rank: int
    scope: str  # Adapter.scope: the namespace's lora_id and the adapter's tag in L2/L3
    created: int = 0  # Unix seconds

    @classmethod
    def of(cls, a: Adapter) -> AdapterRef:
        return cls(id=a.pk, name=a.name, deployment_id=a.deployment_id, deployment=a.deployment.name,
                   tenant_id=a.tenant_id, digest=a.digest, path=a.path, rank=a.rank, scope=a.scope,
                   created=int(a.created.timestamp()))

    def to_worker(self) -> dict:
        return {"name": self.name, "id": self.id, "digest": self.digest, "path": self.path, "scope": self.scope}


def adapter_list(*, deployment) -> QuerySet[Adapter]:
    return (Adapter.objects.filter(deployment=deployment).exclude(state=Adapter.State.DELETED)
            .select_related("deployment", "tenant"))


def adapter_get(*, deployment, name: str) -> Adapter:
    adapter = adapter_list(deployment=deployment).filter(name=name).order_by("-id").first()  # a replacement first
    if adapter is None:
        raise NotFound(f"model {deployment.name!r} has no adapter {name!r}", code="adapter_not_found")
    return adapter


def adapters_by_deployment(deployments) -> dict[int, list[Adapter]]:
    out: dict[int, list[Adapter]] = {}
    for a in (Adapter.objects.filter(deployment__in=deployments).exclude(state=Adapter.State.DELETED)
              .select_related("deployment", "tenant").order_by("name")):
        out.setdefault(a.deployment_id, []).append(a)
    return out


def tenant_adapters(tenant) -> QuerySet[Adapter]:
    return (Adapter.objects.filter(tenant=tenant).exclude(state=Adapter.State.DELETED)
            .select_related("deployment", "tenant").order_by("deployment__name", "name"))


def name_in_use(name: str) -> bool:
    """Is ``name`` an adapter's that is not deleted (a model may not take it)?"""
    return Adapter.objects.filter(name=name).exclude(state=Adapter.State.DELETED).exists()


def usable_for(tenant) -> dict[str, AdapterRef]:
    rows = (Adapter.objects.filter(state=Adapter.State.LIVE, deployment__grants__tenant=tenant,
                                   deployment__active_revision__isnull=False, deployment__deleted_at__isnull=True)
            .filter(Q(tenant__isnull=True) | Q(tenant=tenant)).select_related("deployment").order_by())
    return {a.name: AdapterRef.of(a) for a in rows}


def usable(tenant, name: str) -> AdapterRef | None:
    rows = (Adapter.objects.filter(name=name, state=Adapter.State.LIVE, deployment__grants__tenant=tenant,
                                   deployment__active_revision__isnull=False, deployment__deleted_at__isnull=True)
            .filter(Q(tenant__isnull=True) | Q(tenant=tenant)).select_related("deployment")[:1])
    return next((AdapterRef.of(a) for a in rows), None)

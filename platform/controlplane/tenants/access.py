"""Tenant access writes: grants (which models a tenant may use) and share groups (which tenants
share one scope salt, hence cache entries). Same rules as ``services.py``: keyword-only, atomic,
audited in the same transaction.

Share-group membership changes the tenant's scope salt, so its cache namespace changes at once: a
tenant that joins sees the group's entries from then on, a tenant that leaves stops seeing them.
"""

from __future__ import annotations

from django.db import transaction

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import Conflict, InvalidInput, NotFound
from controlplane.registry.models import ModelDeployment
from controlplane.tenants.models import Grant, ShareGroup, Tenant
from controlplane.tenants.services import validate_slug


def _lock_usable(tenant: Tenant) -> Tenant:
    locked = Tenant.objects.select_for_update().get(pk=tenant.pk)
    if locked.status == Tenant.Status.OFFBOARDED:
        raise Conflict(f"tenant {locked.slug!r} is offboarded", code="tenant_offboarded")
    return locked


def grant_create(*, actor: Actor, tenant: Tenant, deployment: ModelDeployment) -> Grant:
    """Let ``tenant`` use ``deployment``. Conflict when already granted or the tenant is offboarded."""
    with transaction.atomic():
        locked = _lock_usable(tenant)
        if Grant.objects.filter(tenant=locked, deployment=deployment).exists():
            raise Conflict(f"tenant {locked.slug!r} already has model {deployment.name!r}")
        grant = Grant.objects.create(tenant=locked, deployment=deployment)
        audit_record(
            actor=actor, action="grant.create", target=f"{locked.slug}:{deployment.name}", tenant=locked.slug,
            new={"model": deployment.name},
        )
        from controlplane.runtime.warm import warm_after_commit

        warm_after_commit(deployment)  # granted: its replicas start now (where enabled), if not running
    return grant


def grant_delete(*, actor: Actor, tenant: Tenant, deployment: ModelDeployment) -> None:
    """Withdraw the grant; the tenant's next request for the model is a 404. NotFound if not granted."""
    with transaction.atomic():
        deleted, _ = Grant.objects.filter(tenant=tenant, deployment=deployment).delete()
        if not deleted:
            raise NotFound(f"tenant {tenant.slug!r} has no grant for model {deployment.name!r}")
        audit_record(
            actor=actor, action="grant.delete", target=f"{tenant.slug}:{deployment.name}", tenant=tenant.slug,
            old={"model": deployment.name},
        )


def share_group_create(*, actor: Actor, slug: str, name: str) -> ShareGroup:
    """New share group with its own 32-byte scope salt. InvalidInput / Conflict (slug taken)."""
    validate_slug(slug)
    if not name or len(name) > 200:
        raise InvalidInput("name must be 1-200 characters")
    with transaction.atomic():
        if ShareGroup.objects.filter(slug=slug).exists():
            raise Conflict(f"share group {slug!r} already exists")
        group = ShareGroup.objects.create(slug=slug, name=name)
        audit_record(actor=actor, action="share_group.create", target=slug, new={"slug": slug, "name": name})
    return group


def share_group_add(*, actor: Actor, group: ShareGroup, tenant: Tenant, reason: str = "") -> Tenant:
    """Put ``tenant`` in ``group`` (membership is explicit and exclusive). Conflict when it is already
    in this or another group (remove it first) or offboarded."""
    with transaction.atomic():
        locked = _lock_usable(tenant)
        if locked.share_group_id is not None:
            current = ShareGroup.objects.get(pk=locked.share_group_id).slug
            raise Conflict(f"tenant {locked.slug!r} is already in share group {current!r}")
        locked.share_group = group
        locked.save(update_fields=["share_group", "updated"])
        audit_record(
            actor=actor, action="share_group.add", target=group.slug, tenant=locked.slug, reason=reason,
            old={"share_group": None}, new={"share_group": group.slug},
        )
    return locked


def share_group_remove(*, actor: Actor, group: ShareGroup, tenant: Tenant, reason: str = "") -> Tenant:
    """Take ``tenant`` out of ``group``; it falls back to its own salt at once (the scope salt is
    resolved per request), so it stops reusing the group's blocks with its next request. The blocks it
    created (in the group's namespace and its own) are flushed everywhere by a tenant-scope flush job
    requested in the same transaction. NotFound if not a member."""
    with transaction.atomic():
        locked = Tenant.objects.select_for_update().get(pk=tenant.pk)
        if locked.share_group_id != group.pk:
            raise NotFound(f"tenant {locked.slug!r} is not in share group {group.slug!r}")
        locked.share_group = None
        locked.save(update_fields=["share_group", "updated"])
        from controlplane.jobs.services import flush_job_request

        job = flush_job_request(actor=actor, scope="tenant", tenant=locked, reason=f"left share group {group.slug}")
        audit_record(
            actor=actor, action="share_group.remove", target=group.slug, tenant=locked.slug, reason=reason,
            old={"share_group": group.slug}, new={"share_group": None, "flush_job": getattr(job, "pk", None)},
        )
    return locked

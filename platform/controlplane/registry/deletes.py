"""Registry writes of deletes: a deployment or a revision hidden at once (soft delete: jobs keep their
rows), and a deleted deployment's name freed once its delete job succeeded. The jobs that remove
their replicas and KV are in ``jobs.deletes``, which calls these inside its transactions. Audited like every
registry write (``registry.services``).
"""

from __future__ import annotations

from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import Conflict, NotFound
from controlplane.registry.models import ModelDeployment, ModelRevision
from controlplane.registry.services import _revision_view


def model_mark_deleted(*, actor: Actor, name: str, reason: str) -> ModelDeployment:
    """Hide deployment ``name`` from everyone now (``deleted_at``; row-locked, inside the caller's
    transaction), audited ``model.delete``. A deployment already being deleted is returned as it is
    (no event). Raises NotFound for a name with no deployment, or one whose delete succeeded."""
    locked = (ModelDeployment.all_objects.select_for_update(of=("self",)).select_related("active_revision")
              .filter(name=name, purged_at__isnull=True).first())
    if locked is None:
        raise NotFound(f"model {name!r} not found", code="model_not_found")
    if locked.deleted_at is None:
        locked.deleted_at = timezone.now()
        locked.save(update_fields=["deleted_at"])
        audit_record(actor=actor, action="model.delete", target=name, reason=reason,
                     old={"replicas": locked.replicas, "engine": locked.engine,
                          "revision": locked.active_revision.label if locked.active_revision else None},
                     new={"state": "deleting"})
    return locked


def model_mark_purged(*, deployment: ModelDeployment) -> None:
    """The delete job of ``deployment`` succeeded: its name may be used again."""
    ModelDeployment.all_objects.filter(pk=deployment.pk, purged_at__isnull=True).update(purged_at=timezone.now())


def revision_mark_deleted(*, actor: Actor, deployment: ModelDeployment, label: str, reason: str) -> ModelRevision:
    """Hide revision ``label`` of ``deployment`` now (no longer listed, no rollout to it), audited
    ``revision.delete``; inside the caller's transaction, the deployment row-locked so no switch
    makes it active meanwhile. Raises NotFound, or Conflict ``revision_active`` for the active one."""
    locked = ModelDeployment.objects.select_for_update(of=("self",)).filter(pk=deployment.pk).first()
    if locked is None:
        raise NotFound(f"model {deployment.name!r} not found", code="model_not_found")
    revision = ModelRevision.objects.filter(deployment=locked, label=label).first()
    if revision is None:
        raise NotFound(f"model {deployment.name!r} has no revision {label!r}", code="revision_not_found")
    if locked.active_revision_id == revision.pk:
        raise Conflict(f"revision {label!r} is the active revision of {deployment.name!r}: roll out another "
                       "revision first", code="revision_active")
    revision.deleted_at = timezone.now()
    revision.save(update_fields=["deleted_at"])
    audit_record(actor=actor, action="revision.delete", target=f"{deployment.name}@{label}", reason=reason,
                 old=_revision_view(revision))
    return revision

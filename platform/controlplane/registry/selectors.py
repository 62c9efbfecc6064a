"""Registry reads."""

from __future__ import annotations

from django.db.models import QuerySet

from controlplane.common.errors import NotFound
from controlplane.registry.models import ModelDeployment, ModelRevision


def model_list() -> QuerySet[ModelDeployment]:
    return ModelDeployment.objects.select_related("active_revision").prefetch_related("revisions")


def model_get(*, name: str) -> ModelDeployment:
    """The deployment called ``name``; raises NotFound."""
    deployment = model_list().filter(name=name).first()
    if deployment is None:
        raise NotFound(f"model {name!r} not found", code="model_not_found")
    return deployment


def revision_get(*, deployment: ModelDeployment, label: str) -> ModelRevision:
    """The revision ``label`` of ``deployment``; raises NotFound."""
    revision = ModelRevision.objects.filter(deployment=deployment, label=label).first()
    if revision is None:
        raise NotFound(f"model {deployment.name!r} has no revision {label!r}", code="revision_not_found")
    return revision

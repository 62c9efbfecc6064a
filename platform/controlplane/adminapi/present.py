"""Model -> output dict shaping shared by the routers. Scopes appear only as fingerprints."""

from __future__ import annotations

from typing import Any

from controlplane.audit.models import AuditEvent
from controlplane.hashing.selectors import digest_state
from controlplane.registry.models import ModelDeployment, ModelRevision
from controlplane.tenants.models import ApiKey, ShareGroup, Tenant
from controlplane.tenants.selectors import scope_fingerprint, tenant_scope_fingerprint


def tenant_out(tenant: Tenant) -> dict[str, Any]:
    return {
        "slug": tenant.slug,
        "name": tenant.name,
        "status": tenant.status,
        "quotas": tenant.quotas,
        "share_group": tenant.share_group.slug if tenant.share_group_id else None,
        "scope_fingerprint": tenant_scope_fingerprint(tenant),
        "created": tenant.created,
        "updated": tenant.updated,
    }


def key_out(key: ApiKey) -> dict[str, Any]:
    return {
        "id": key.pk, "prefix": key.prefix, "name": key.name, "created": key.created,
        "last_used": key.last_used, "revoked_at": key.revoked_at,
    }


def revision_out(revision: ModelRevision, active_id: int | None) -> dict[str, Any]:
    return {
        "label": revision.label, "source": revision.source, "seed": revision.seed,
        "weights_path": revision.weights_path, "path": revision.checkpoint_path, "digest": revision.digest,
        "digest_state": digest_state(revision), "active": revision.pk == active_id, "created": revision.created,
    }


def model_out(deployment: ModelDeployment) -> dict[str, Any]:
    active_id = deployment.active_revision_id
    revisions = sorted(deployment.revisions.all(), key=lambda r: r.pk)
    active = next((r.label for r in revisions if r.pk == active_id), None)
    outs = [revision_out(r, active_id) for r in revisions]
    return {
        "name": deployment.name, "preset": deployment.preset, "architecture": deployment.architecture,
        "tokenizer": deployment.tokenizer, "replicas": deployment.replicas, "engine": deployment.engine,
        "tensor_parallel_size": deployment.tensor_parallel_size, "active_revision": active,
        "revisions": outs, "created": deployment.created,
        "status": "stopped" if deployment.replicas == 0 else "running",
        "digest_state": next((r["digest_state"] for r in outs if r["active"]), None),
    }


def share_group_out(group: ShareGroup) -> dict[str, Any]:
    return {
        "slug": group.slug, "name": group.name, "scope_fingerprint": scope_fingerprint(group.scope_salt),
        "members": sorted(t.slug for t in group.members.all()), "created": group.created,
    }


def audit_event_out(event: AuditEvent) -> dict[str, Any]:
    return {
        "seq": event.seq, "time": event.time, "actor": event.actor, "auth_method": event.auth_method,
        "source": event.source, "peer": event.peer or "", "forwarded_for": event.forwarded_for or "",
        "action": event.action, "target": event.target, "tenant": event.tenant,
        "old": event.old_value, "new": event.new_value, "reason": event.reason, "result": event.result,
        "prev_hash": event.prev_hash, "hash": event.hash,
    }

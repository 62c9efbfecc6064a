"""Adapter writes: register (``adapter_create``) and delete (``adapter_delete``: an ``adapter_delete``
job, which marks the adapter deleted once its KV is gone: ``jobs.services``). Each is audited. A
private adapter past its tenant's ``max_adapters`` (its live private adapters; public adapters count
for no tenant) is a 409 ``quota_exceeded``.

Registration checks the PEFT directory against the base deployment's active checkpoint
(``adapters.peft``): 422 ``invalid_adapter`` with the reason; 422 ``adapters_need_vllm`` on a deployment
of the reference engine (vLLM serves LoRA; the reference engine does not); 409 ``adapter_exists`` for a
name already registered (replace an adapter by deleting it, then registering the new files) and
``name_taken`` for a deployment's name; 422 ``adapters_unsupported`` on a mixture of experts (served
without LoRA: ``workers.vllm_revision.lora_settings``); 422 ``adapters_disabled`` where vLLM starts
without LoRA (``STRATA_LORA_MAX_LORAS=0``).
"""

from __future__ import annotations

import json
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from cachecore.model import peft
from controlplane.adapters.models import Adapter
from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.registry.models import ModelDeployment, name_validator

DEFAULT_MAX_RANK = 64


def max_rank() -> int:
    return int(getattr(settings, "STRATA_LORA_MAX_RANK", DEFAULT_MAX_RANK))


def _describe(a: Adapter) -> dict:
    return {"name": a.name, "model": a.deployment.name, "tenant": a.tenant.slug if a.tenant_id else None,
            "digest": a.digest, "rank": a.rank, "path": a.path}


def _inspect(deployment: ModelDeployment, path) -> peft.AdapterInfo:
    revision = deployment.active_revision
    if revision is None or not revision.checkpoint_path:
        raise InvalidInput(f"model {deployment.name!r} has no active checkpoint revision to adapt",
                           code="invalid_adapter")
    if not isinstance(path, str) or not path.strip():
        raise InvalidInput("path must be the adapter's directory", code="invalid_adapter")
    root = settings.STRATA_WEIGHTS_ROOT
    try:
        config = json.loads((Path(revision.checkpoint_path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and peft.is_moe(config):
        raise InvalidInput(f"model {deployment.name!r} is a mixture of experts, which vLLM serves without LoRA here",
                           code="adapters_unsupported")
    try:
        base = peft.base_shapes(Path(revision.checkpoint_path))
        return peft.inspect_adapter(path, base=base, max_rank=max_rank(), root=Path(root) if root else None)
    except (peft.AdapterError, ValueError) as exc:  # CheckpointError is a ValueError
        raise InvalidInput(str(exc), code="invalid_adapter") from None


def _check_quota(tenant) -> None:
    """409 ``quota_exceeded`` when ``tenant`` has as many live private adapters as its ``max_adapters``.
    The tenant's row stays locked until the caller's transaction ends (as ``caches.services.cache_create``
    does for pins): concurrent registrations for one tenant take turns, so they never add up past it."""
    from controlplane.tenants.models import Tenant

    locked = Tenant.objects.select_for_update().only("pk", "slug", "max_adapters").get(pk=tenant.pk)
    if locked.max_adapters is None:
        return
    used = Adapter.objects.filter(tenant=locked, state=Adapter.State.LIVE).count()
    if used >= locked.max_adapters:
        raise Conflict(f"tenant {locked.slug!r} has {used} private adapter(s), its max_adapters quota is "
                       f"{locked.max_adapters}: delete one or raise the quota", code="quota_exceeded")


def adapter_create(*, actor: Actor, deployment: ModelDeployment, name, path, tenant=None) -> Adapter:
    """Register adapter ``name`` (the PEFT directory ``path``) on ``deployment``, private to ``tenant``
    (a Tenant) or, without one, usable by every tenant granted the deployment."""
    if deployment.engine != ModelDeployment.Engine.VLLM:
        raise InvalidInput(f"model {deployment.name!r} runs on the reference engine, which serves no LoRA "
                           "adapters: serve the base checkpoint with engine 'vllm' to add adapters",
                           code="adapters_need_vllm")
    if int(getattr(settings, "STRATA_LORA_MAX_LORAS", 4)) <= 0:
        raise InvalidInput("this platform starts vLLM without LoRA (STRATA_LORA_MAX_LORAS=0): set it above 0 "
                           "and restart the replicas to serve adapters", code="adapters_disabled")
    if not isinstance(name, str) or not name:
        raise InvalidInput("name is required", code="invalid_name")
    try:
        name_validator(name)
    except Exception:
        raise InvalidInput("name: use 1-100 characters A-Z, a-z, 0-9, '.', '_' and '-'", code="invalid_name") from None
    if ModelDeployment.objects.filter(name=name).exists():
        raise Conflict(f"{name!r} is a model's name; an adapter needs a name of its own", code="name_taken")
    if Adapter.objects.filter(name=name).exclude(state=Adapter.State.DELETED).exists():
        raise Conflict(f"adapter {name!r} exists; to replace its files, PUT them to it",
                       code="adapter_exists")
    info = _inspect(deployment, path)
    try:
        with transaction.atomic():
            if tenant is not None:
                _check_quota(tenant)
            adapter = Adapter.objects.create(
                name=name, deployment=deployment, tenant=tenant, path=info.path, digest=info.digest, rank=info.rank,
                alpha=info.alpha, target_modules=list(info.target_modules), dtype=info.dtype)
            audit_record(actor=actor, action="adapter.create", target=f"adapter:{name}",
                         tenant=tenant.slug if tenant else "", new=_describe(adapter))
    except IntegrityError:  # registered by a concurrent request meanwhile
        raise Conflict(f"adapter {name!r} exists", code="adapter_exists") from None
    return adapter


def adapter_replace(*, actor: Actor, adapter: Adapter, path, reason: str = ""):
    """Serve new files under ``adapter``'s name (its tenant and model kept): the new registration is a
    new scope, live at once, and the old one's KV leaves every tier through its ``adapter_delete`` job
    (flushed on every replica, unloaded from vLLM, verified), which stops the old scope from serving;
    requests already running on it finish on it. 409 ``adapter_unchanged`` for the same files.
    Returns ``(new adapter, job)``."""
    deployment = adapter.deployment
    info = _inspect(deployment, path)
    with transaction.atomic():
        old = (Adapter.objects.select_for_update(of=("self",)).select_related("deployment", "tenant")
               .get(pk=adapter.pk))
        if old.state != Adapter.State.LIVE:
            raise Conflict(f"adapter {old.name!r} is being deleted", code="adapter_not_found")
        if old.digest == info.digest:
            raise Conflict(f"adapter {old.name!r} already serves these files", code="adapter_unchanged")
        old.state = Adapter.State.DELETING
        old.save(update_fields=["state"])
        new = Adapter.objects.create(
            name=old.name, deployment=deployment, tenant=old.tenant, path=info.path, digest=info.digest,
            rank=info.rank, alpha=info.alpha, target_modules=list(info.target_modules), dtype=info.dtype)
        audit_record(actor=actor, action="adapter.replace", target=f"adapter:{old.name}",
                     tenant=old.tenant.slug if old.tenant_id else "", old=_describe(old), new=_describe(new),
                     reason=reason or "adapter replaced")
        from controlplane.jobs.services import adapter_delete_request

        job = adapter_delete_request(actor=actor, adapter=old,
                                     reason=reason or f"adapter {old.name} replaced by new files")
    return new, job


def adapter_delete(*, actor: Actor, adapter: Adapter, reason: str = ""):
    """Stop serving ``adapter`` now and queue the ``adapter_delete`` job that removes its KV from every
    tier on every replica (and unloads it from vLLM), verified; the job marks it deleted. Returns the job."""
    from controlplane.jobs.models import FlushJob
    from controlplane.jobs.services import adapter_delete_request

    with transaction.atomic():
        locked = (Adapter.objects.select_for_update(of=("self",)).select_related("deployment", "tenant")
                  .get(pk=adapter.pk))
        if locked.state == Adapter.State.DELETED:
            raise Conflict(f"adapter {adapter.name!r} is deleted", code="adapter_not_found")
        pending = FlushJob.objects.filter(adapter=locked, kind=FlushJob.Kind.ADAPTER_DELETE).exclude(
            status__in=FlushJob.FINAL).first()
        if pending is not None:
            return pending
        locked.state = Adapter.State.DELETING
        locked.save(update_fields=["state"])
        audit_record(actor=actor, action="adapter.delete", target=f"adapter:{locked.name}",
                     tenant=locked.tenant.slug if locked.tenant_id else "", old=_describe(locked),
                     reason=reason or "adapter deleted")
        return adapter_delete_request(actor=actor, adapter=locked, reason=reason or f"delete adapter {locked.name}")


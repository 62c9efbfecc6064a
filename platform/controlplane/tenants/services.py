"""Tenant writes: tenants, quotas, cache policy, API keys. Grants and share groups live in
``access.py``, data keys (L3 encryption) in ``datakeys.py``.

Every service is keyword-only, validates, writes inside ``transaction.atomic`` and appends its audit
event in the same transaction (no change without its event). Audit values never hold keys, key
hashes or salts: keys appear by prefix only.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, NamedTuple

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import Conflict, InvalidInput, Unavailable
from controlplane.common.tokens import new_secret
from controlplane.tenants.models import (
    RETENTION_MAX_SECONDS,
    ApiKey,
    DataKey,
    Tenant,
    slug_validator,
)
from controlplane.tenants.quotas import audited as audited_quotas  # audit values, with ``effective``
from controlplane.tenants.quotas import clean as clean_quotas  # bounds, and the 422's message

KEY_KIND = "sk-st-"
LAST_USED_RESOLUTION = timedelta(seconds=60)


class OffboardResult(NamedTuple):
    tenant: Tenant
    keys_revoked: int
    flush_job: Any  # the jobs app's FlushJob, or None before that app exists


CACHE_POLICY_FIELDS = {"persist": "persist_kv", "retention_seconds": "retention_seconds"}


def clean_cache_policy(policy: Mapping[str, Any]) -> dict[str, bool | int]:
    """Validate a (partial) cache policy ``{"persist": bool, "retention_seconds": int}`` and return it
    by column name (``persist_kv``, ``retention_seconds``)."""
    unknown = sorted(set(policy) - set(CACHE_POLICY_FIELDS))
    if unknown:
        raise InvalidInput(f"unknown cache_policy field(s): {', '.join(unknown)}; known: persist, retention_seconds")
    cleaned: dict[str, bool | int] = {}
    if "persist" in policy:
        if not isinstance(policy["persist"], bool):
            raise InvalidInput("cache_policy.persist must be true or false")
        cleaned["persist_kv"] = policy["persist"]
    if "retention_seconds" in policy:
        value = policy["retention_seconds"]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= RETENTION_MAX_SECONDS:
            raise InvalidInput(f"cache_policy.retention_seconds must be an integer in [0, {RETENTION_MAX_SECONDS}]")
        cleaned["retention_seconds"] = value
    return cleaned


def validate_slug(slug: str, what: str = "slug") -> None:
    try:
        slug_validator(slug)
    except ValidationError as exc:
        raise InvalidInput(f"{what}: {'; '.join(exc.messages)}") from None


def _locked(tenant: Tenant) -> Tenant:
    return Tenant.objects.select_for_update().get(pk=tenant.pk)


def _not_offboarded(tenant: Tenant) -> None:
    if tenant.status == Tenant.Status.OFFBOARDED:
        raise Conflict(f"tenant {tenant.slug!r} is offboarded", code="tenant_offboarded")


def tenant_create(
    *, actor: Actor, slug: str, name: str, quotas: Mapping[str, Any] | None = None
) -> Tenant:
    """Create an active tenant with a fresh 32-byte scope salt. InvalidInput / Conflict (slug taken)."""
    validate_slug(slug)
    if not name or len(name) > 200:
        raise InvalidInput("name must be 1-200 characters")
    cleaned = clean_quotas(quotas or {})
    with transaction.atomic():
        if Tenant.objects.filter(slug=slug).exists():
            raise Conflict(f"tenant {slug!r} already exists")
        tenant = Tenant.objects.create(slug=slug, name=name, **cleaned)
        audit_record(
            actor=actor, action="tenant.create", target=slug, tenant=slug,
            new={"slug": slug, "name": name, "status": tenant.status, "quotas": audited_quotas(tenant.quotas)},
        )
    return tenant


def tenant_update(
    *,
    actor: Actor,
    tenant: Tenant,
    name: str | None = None,
    status: str | None = None,
    quotas: Mapping[str, Any] | None = None,
    cache_policy: Mapping[str, Any] | None = None,
    reason: str = "",
) -> Tenant:
    """Change name, status (``active`` <-> ``suspended``), some quotas (a ``None`` quota value means
    unlimited; omitted quotas are unchanged) and/or the cache policy (``{"persist",
    "retention_seconds"}``, each optional). One audit event per kind of change (``tenant.update``,
    ``tenant.suspend``/``tenant.activate``, ``tenant.quotas``, ``tenant.cache_policy``); nothing
    changed, nothing recorded. Offboarded tenants cannot change (Conflict). Turning persistence off
    or lowering the retention also queues an audited L3 job (``_queue_l3_policy_job``)."""
    if name is not None and (not name or len(name) > 200):
        raise InvalidInput("name must be 1-200 characters")
    if status is not None and status not in (Tenant.Status.ACTIVE, Tenant.Status.SUSPENDED):
        raise InvalidInput("status must be 'active' or 'suspended' (offboard with DELETE)")
    cleaned = clean_quotas(quotas or {})
    policy = clean_cache_policy(cache_policy or {})
    with transaction.atomic():
        locked = _locked(tenant)
        _not_offboarded(locked)
        record = {"actor": actor, "target": locked.slug, "tenant": locked.slug, "reason": reason}
        changes = 0
        if name is not None and name != locked.name:
            audit_record(action="tenant.update", old={"name": locked.name}, new={"name": name}, **record)
            locked.name, changes = name, changes + 1
        if status is not None and status != locked.status:
            verb = "suspend" if status == Tenant.Status.SUSPENDED else "activate"
            audit_record(action=f"tenant.{verb}", old={"status": locked.status}, new={"status": status}, **record)
            locked.status, changes = status, changes + 1
        quota_changes = {k: v for k, v in cleaned.items() if getattr(locked, k) != v}
        if quota_changes:
            old = {k: getattr(locked, k) for k in quota_changes}
            audit_record(action="tenant.quotas", old=audited_quotas(old), new=audited_quotas(quota_changes),
                         **record)
            for key, value in quota_changes.items():
                setattr(locked, key, value)
            changes += 1
        policy_changes = {k: v for k, v in policy.items() if getattr(locked, k) != v}
        if policy_changes:
            old_policy = locked.cache_policy
            for key, value in policy_changes.items():
                setattr(locked, key, value)
            audit_record(action="tenant.cache_policy", old=old_policy, new=locked.cache_policy, **record)
            _queue_l3_policy_job(actor=actor, tenant=locked, old=old_policy, reason=reason)
            changes += 1
        if changes:
            locked.save()
    if status == Tenant.Status.SUSPENDED:  # also when already suspended: a retry finishes the stop
        _stop_running_requests(actor=actor, tenant=locked, reason="tenant suspended")
    return locked


def _stop_running_requests(*, actor: Actor, tenant: Tenant, reason: str, strict: bool = True) -> None:
    """Stop the tenant's running and waiting requests on every replica (``gateway.cancel_tenant``),
    after its new status committed (so no new request is admitted) and before the change is reported
    done. Audited as ``tenant.requests_stopped`` when any was stopped or a replica failed.
    ``Unavailable`` (503) when a replica could not be reached and ``strict``: the status change
    stands, and repeating it retries the stop (not ``strict``: a job retries it)."""
    from controlplane.runtime.gateway import cancel_tenant

    result = cancel_tenant(tenant.pk, reason=reason)
    stopped = sum(int(r.get("cancelled", 0)) for r in result["replicas"].values())
    if stopped or result["failed"]:  # nothing was running anywhere: the status event says it all
        audit_record(actor=actor, action="tenant.requests_stopped", target=tenant.slug, tenant=tenant.slug,
                     reason=reason, new={"stopped": stopped, "failed": result["failed"]},
                     result="error" if result["failed"] else "ok")
    if result["failed"] and strict:
        raise Unavailable(f"the tenant is {tenant.status}, but {len(result['failed'])} replica(s) could not be "
                          "reached to stop its running requests; repeat the change to retry", retry_after=5)


def _queue_l3_policy_job(*, actor: Actor, tenant: Tenant, old: Mapping[str, Any], reason: str) -> Any:
    """The cache policy is a property of the data already stored: persistence turned off queues an
    ``l3_delete`` job (every L3 object of the tenant, on every replica), a lowered retention an
    ``l3_expire`` job (every replica deletes what the new retention makes too old). Each job is
    audited by its request (``l3_delete.request`` / ``l3_expire.request``). Reads stop at once
    without waiting for the job: a request of a tenant that may not persist never reads L3, and a
    read never serves an object older than the requester's current retention. Inside the caller's
    transaction (the job is enqueued on commit)."""
    from controlplane.jobs.services import flush_job_request

    if old["persist"] and not tenant.persist_kv:
        kind, why = "l3_delete", "cache policy: persistence turned off"
    elif tenant.persist_kv and tenant.retention_seconds < old["retention_seconds"]:
        kind, why = "l3_expire", f"cache policy: retention lowered to {tenant.retention_seconds} s"
    else:
        return None
    return flush_job_request(actor=actor, scope="tenant", tenant=tenant, reason=reason or why, kind=kind)


def tenant_offboard(*, actor: Actor, tenant: Tenant, reason: str = "") -> OffboardResult:
    """Offboard: revoke every key at once, mark the tenant offboarded and request one ``offboard`` job.
    That one job crypto-shreds every version of the tenant's data key and flushes its caches
    everywhere, as steps: the wrapped keys are deleted first, then the flush, then every worker drops
    the keys and their L3 objects, verified per version. An offboarded tenant never gets a data key
    again. Safe to repeat: a repeat revokes nothing new and requests the job again."""
    with transaction.atomic():
        locked = _locked(tenant)
        old_status = locked.status
        keys_revoked = ApiKey.objects.filter(tenant=locked, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
        locked.status = Tenant.Status.OFFBOARDED
        locked.save(update_fields=["status", "updated"])
        from controlplane.caches.services import caches_forget_tenant
        from controlplane.jobs.services import flush_job_request

        job = flush_job_request(actor=actor, scope="tenant", tenant=locked, reason=reason or "tenant offboarded",
                                kind="offboard")
        caches_forget_tenant(locked)  # the offboard job deletes their bytes with the tenant's cache
        from controlplane.conversations.services import responses_forget_tenant

        responses_forget_tenant(locked)  # its stored responses (Responses API) go with it
        audit_record(
            actor=actor, action="tenant.offboard", target=locked.slug, tenant=locked.slug, reason=reason,
            old={"status": old_status},
            new={"status": locked.status, "keys_revoked": keys_revoked, "flush_job": getattr(job, "pk", None),
                 "data_key_versions": list(DataKey.objects.filter(tenant=locked).order_by("version")
                                           .values_list("version", flat=True))},
        )
    # Its streams stop now; the offboard job stops them again on every worker (retried) before it goes on.
    _stop_running_requests(actor=actor, tenant=locked, reason="tenant offboarded", strict=False)
    return OffboardResult(tenant=locked, keys_revoked=keys_revoked, flush_job=job)


def api_key_create(*, actor: Actor, tenant: Tenant, name: str = "") -> tuple[ApiKey, str]:
    """New key for ``tenant``: returns ``(ApiKey, raw_key)``. The raw key exists only in this return
    value: store or log it nowhere. Conflict for an offboarded tenant."""
    if len(name) > 100:
        raise InvalidInput("key name must be at most 100 characters")
    secret = new_secret(KEY_KIND)
    with transaction.atomic():
        locked = _locked(tenant)
        _not_offboarded(locked)
        key = ApiKey.objects.create(tenant=locked, name=name, prefix=secret.prefix, key_hash=secret.digest)
        audit_record(
            actor=actor, action="key.create", target=key.prefix, tenant=locked.slug,
            new={"id": key.pk, "prefix": key.prefix, "name": name},
        )
    return key, secret.raw


def api_key_revoke(*, actor: Actor, api_key: ApiKey, reason: str = "") -> ApiKey:
    """Revoke now (the next request with it fails). Revoking a revoked key is a no-op."""
    with transaction.atomic():
        key = ApiKey.objects.select_for_update().select_related("tenant").get(pk=api_key.pk)
        if key.revoked_at is None:
            key.revoked_at = timezone.now()
            key.save(update_fields=["revoked_at"])
            audit_record(
                actor=actor, action="key.revoke", target=key.prefix, tenant=key.tenant.slug, reason=reason,
                new={"id": key.pk, "prefix": key.prefix},
            )
    return key


def api_key_mark_used(*, api_key: ApiKey) -> None:
    """Record use for the serving API; writes at most once per minute per key (not audited). The
    object's ``last_used`` follows, so a key object the serving path keeps (``serving.access_cache``)
    writes again only a minute later."""
    now = timezone.now()
    if api_key.last_used is not None and now - api_key.last_used < LAST_USED_RESOLUTION:
        return  # the row just read is recent enough: no UPDATE on the hot path
    stale = Q(last_used__isnull=True) | Q(last_used__lt=now - LAST_USED_RESOLUTION)
    ApiKey.objects.filter(stale, pk=api_key.pk).update(last_used=now)
    api_key.last_used = now

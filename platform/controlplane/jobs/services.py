"""Write side of jobs: request a flush / rollout / offboard / shred, and execute one (called by the task).

Every replica of a deployment is a worker here: results are keyed by actor name
(``cache-worker:<deployment>:<i>``, one per replica the registry configures, addressed through the
gateway's ``ReplicaSet``), and verification probes each replica, recorded per replica in the
``verified`` step. Execution is idempotent: each worker's result is recorded as soon as it is known,
and a retried or resumed execution skips the workers already done, so a crash mid-job followed by a retry completes
the job with no double effects. Every request and final state is audited.

Crypto-shredding (``shred`` jobs, one data-key version; ``offboard`` jobs, after their flush, every
version of the tenant). Both jobs first make every worker stop the tenant's running and waiting
requests (``cancel_tenant``, results ``<actor>:cancel``), so no stream outlives its key or tenant:

1. the wrapped keys are deleted in the database (``tenants.keystore.data_key_destroy``: state
   ``shredded``, ``wrapped`` NULL, audited), with the job's step, in one transaction: from then on
   no process can unwrap them;
2. after ``STRATA_DATA_KEY_CACHE_SECONDS`` (no web process still hands the key out in a worker
   request), every worker's ``drop_data_key({"tenant", "version"})`` drops it from its keyring and
   deletes that version's L3 objects (``{"objects", "bytes"}``), one recorded result per worker and
   version;
3. ``probe({"scope": "key_version", "tenant", "version"})`` on every worker must report nothing left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.celery_app import app as celery_app
from controlplane.common.actor import Actor
from controlplane.common.errors import Conflict, InvalidInput, NotFound, Unavailable
from controlplane.jobs.models import FlushJob
from controlplane.registry.models import ModelDeployment, ModelRevision
from controlplane.registry.services import model_activate_revision
from controlplane.runtime import gateway
from controlplane.tenants.keystore import data_key_destroy
from controlplane.tenants.models import DataKey, Tenant
from workers.actor import actor_name

logger = logging.getLogger("controlplane.jobs")

RUN_JOB = "strata.run_job"  # the Celery task that runs a job (``jobs.tasks.run_job``), enqueued by name
DRAIN_SECONDS = 10.0  # default drain deadline for running requests of a replaced revision
# Per-worker result states that need no retry. ``not_running``: the replica was never started (or is
# stopped), so it holds nothing and there is nothing to do (``absent`` in rows written before).
NOT_RUNNING = "not_running"
DONE = ("ok", NOT_RUNNING, "absent", "skipped")


class RetryLater(Exception):
    """Some workers could not be reached; the task retries with backoff."""


# Job kinds run by another module (kind -> its executor, ``(job, final_attempt) -> job``), which
# registers itself when the app is ready (``jobs.deletes``): this module never imports it.
EXECUTORS: dict[str, Callable[[FlushJob, bool], FlushJob]] = {}


def job_send(job_id: int) -> None:
    """Send ``RUN_JOB`` for ``job_id`` now. By name, on Strata's Celery app: nothing but Celery imports
    the tasks module (the tasks import the services), so there is no import cycle."""
    celery_app.send_task(RUN_JOB, args=[job_id])


def _send_or_leave_queued(job_id: int) -> None:
    """``job_send``, or, when the broker cannot take the message (down, paused, unreachable), leave the
    job queued: it is recorded, the operator's request succeeds, and the Celery workers' reaper sends
    it again once it has waited a staleness window (``signals.resume_stale_jobs``)."""
    try:
        job_send(job_id)
    except Exception as exc:  # kombu's and redis-py's connection errors have no common base
        logger.warning("job %s stays queued: the broker did not take it (%s: %s); it is sent again later",
                       job_id, type(exc).__name__, exc)


def _enqueue(job: FlushJob) -> None:
    """Send the job once the transaction commits (``_send_or_leave_queued``)."""
    transaction.on_commit(lambda: _send_or_leave_queued(job.pk))


def _step(job: FlushJob, step: str, **detail) -> None:
    job.steps = [*job.steps, {"at": timezone.now().isoformat(), "step": step, **detail}]


def flush_job_request(
    *,
    actor: Actor,
    scope: str,
    reason: str,
    tenant: Tenant | str | None = None,
    model: str | None = None,
    revision: str | None = None,
    kind: str = FlushJob.Kind.FLUSH,
) -> FlushJob:
    """Create a flush job for ``scope`` (tenant | model | revision | all) and enqueue it on commit.
    ``tenant`` is a slug or a Tenant (offboarding passes the row it has locked). ``kind`` ``l3_delete``
    / ``l3_expire`` (scope tenant; requested by ``tenants.services.tenant_update`` when the cache
    policy changes) touch only the tenant's L3 objects, on every replica of every deployment."""
    if not reason or not reason.strip():
        raise InvalidInput("a reason is required", code="reason_required")
    if scope not in FlushJob.Scope.values:
        raise InvalidInput(f"scope must be one of {', '.join(FlushJob.Scope.values)}", code="invalid_scope")
    fields: dict = {}
    if scope == FlushJob.Scope.TENANT:
        if not tenant:
            raise InvalidInput("scope 'tenant' needs 'tenant'", code="tenant_required")
        fields["tenant"] = tenant if isinstance(tenant, Tenant) else (
            Tenant.objects.filter(slug=tenant).first() or _missing("tenant", tenant))
    if scope in (FlushJob.Scope.MODEL, FlushJob.Scope.REVISION):
        if not model:
            raise InvalidInput(f"scope '{scope}' needs 'model'", code="model_required")
        fields["deployment"] = ModelDeployment.objects.filter(name=model).first() or _missing("model", model)
    if scope == FlushJob.Scope.REVISION:
        if not revision:
            raise InvalidInput("scope 'revision' needs 'revision'", code="revision_required")
        fields["revision"] = (ModelRevision.objects.filter(deployment=fields["deployment"], label=revision).first()
                              or _missing("revision", revision))
    with transaction.atomic():
        job = FlushJob.objects.create(kind=kind, scope=scope, reason=reason.strip(), requested_by=actor.name,
                                      auth_method=actor.auth_method, **fields)
        _step(job, "requested", by=actor.name)
        job.save(update_fields=["steps"])
        audit_record(actor=actor, action=f"{kind}.request", target=f"job:{job.pk}",
                     tenant=job.tenant.slug if job.tenant_id else "", new=_describe(job), reason=job.reason)
        _enqueue(job)
    return job


def is_rollback(deployment: ModelDeployment, target: ModelRevision) -> bool:
    """Going to a revision added before the active one (one that was retired, or skipped)."""
    active = deployment.active_revision
    return active is not None and (target.created, target.pk) < (active.created, active.pk)


def rollout_request(*, actor: Actor, model: str, revision: str, reason: str = "", rollback: bool = False,
                    confirm: str = "") -> FlushJob:
    """Request the weight-revision rollout protocol for ``model`` to ``revision`` (a job). A rollback
    (``is_rollback``) must be asked for as one: ``rollback`` and the model's name in ``confirm``
    (409 ``rollback_not_confirmed`` otherwise), so a careless click never rolls back. A revision whose
    digest is not known yet (``hashing``) is 409 ``revision_not_ready``."""
    deployment = ModelDeployment.objects.filter(name=model).first() or _missing("model", model)
    target = ModelRevision.objects.filter(deployment=deployment, label=revision).first() or _missing(
        "revision", revision)
    if deployment.active_revision_id == target.pk:
        raise Conflict(f"revision '{revision}' is already active for '{model}'", code="already_active")
    if not target.digest:  # its weights are still being hashed (or that failed): nothing may serve them
        from controlplane.hashing.selectors import digest_state

        raise Conflict(f"revision '{revision}' cannot be rolled out yet: {digest_state(target)['message']}",
                       code="revision_not_ready")
    back = is_rollback(deployment, target)
    if back and not (rollback and confirm.strip() == model):
        raise Conflict(f"revision '{revision}' is older than the active '{deployment.active_revision.label}': "
                       f"a rollback; ask for it as one (rollback: true, confirm: the model's name)",
                       code="rollback_not_confirmed")
    with transaction.atomic():
        job = FlushJob.objects.create(
            kind=FlushJob.Kind.ROLLOUT, scope=FlushJob.Scope.REVISION, deployment=deployment, revision=target,
            from_revision=deployment.active_revision, reason=(reason or f"rollout to {revision}").strip(),
            requested_by=actor.name, auth_method=actor.auth_method,
        )
        _step(job, "requested", by=actor.name, to=revision, rollback=back,
              **({"from": deployment.active_revision.label} if deployment.active_revision else {}))
        job.save(update_fields=["steps"])
        audit_record(actor=actor, action="rollback.request" if back else "rollout.request", target=f"model:{model}",
                     old={"revision": job.from_revision.label if job.from_revision else None},
                     new={"revision": revision, "job": job.pk, "rollback": back}, reason=job.reason)
        _enqueue(job)
    return job


def shred_job_request(*, actor: Actor, tenant: Tenant, version: int, reason: str) -> FlushJob:
    """Create a ``shred`` job for data-key ``version`` of ``tenant`` and enqueue it on commit (called
    by ``tenants.datakeys.data_key_shred``, which validates the version and rotates first if needed)."""
    if not reason or not reason.strip():
        raise InvalidInput("a reason is required", code="reason_required")
    with transaction.atomic():
        job = FlushJob.objects.create(kind=FlushJob.Kind.SHRED, scope=FlushJob.Scope.TENANT, tenant=tenant,
                                      key_version=version, reason=reason.strip(), requested_by=actor.name,
                                      auth_method=actor.auth_method)
        _step(job, "requested", by=actor.name, version=version)
        job.save(update_fields=["steps"])
        audit_record(actor=actor, action="shred.request", target=f"job:{job.pk}", tenant=tenant.slug,
                     new=_describe(job), reason=job.reason)
        _enqueue(job)
    return job


def adapter_delete_request(*, actor: Actor, adapter, reason: str) -> FlushJob:
    """Create the ``adapter_delete`` job of ``adapter`` (an ``adapters.models.Adapter``, already no
    longer served) on its base deployment and enqueue it on commit (``adapters.services.adapter_delete``)."""
    with transaction.atomic():
        job = FlushJob.objects.create(kind=FlushJob.Kind.ADAPTER_DELETE, scope=FlushJob.Scope.MODEL,
                                      deployment_id=adapter.deployment_id, adapter=adapter, reason=reason.strip(),
                                      requested_by=actor.name, auth_method=actor.auth_method)
        _step(job, "requested", by=actor.name, adapter=adapter.name, digest=adapter.digest)
        job.save(update_fields=["steps"])
        audit_record(actor=actor, action="adapter_delete.request", target=f"job:{job.pk}",
                     tenant=adapter.tenant.slug if adapter.tenant_id else "",
                     new={**_describe(job), "adapter": adapter.name}, reason=job.reason)
        _enqueue(job)
    return job


def _missing(what: str, name: str):
    raise NotFound(f"{what} '{name}' not found", code=f"{what}_not_found")


def _describe(job: FlushJob) -> dict:
    return {
        "job": job.pk, "kind": job.kind, "scope": job.scope,
        "tenant": job.tenant.slug if job.tenant_id else None,
        "model": job.deployment.name if job.deployment_id else None,
        "revision": job.revision.label if job.revision_id else None,
        **({"version": job.key_version} if job.key_version else {}),
    }


# ---------------------------------------------------------------------- execution
def _targets(job: FlushJob) -> list[ModelDeployment]:
    if job.deployment_id:  # a job reaches its deployment even once it is being deleted
        return [ModelDeployment.all_objects.select_related("active_revision").get(pk=job.deployment_id)]
    return list(ModelDeployment.objects.select_related("active_revision").filter(active_revision__isnull=False)
                .order_by("name"))


def _worker_scope(job: FlushJob) -> dict:
    if job.kind == FlushJob.Kind.ADAPTER_DELETE:  # every tier's KV of the adapter, and vLLM unloads it
        return {"scope": "adapter", "adapter": job.adapter.scope, "lora_id": job.adapter.pk}
    if job.kind == FlushJob.Kind.L3_DELETE:
        return {"scope": "tenant_l3", "tenant": str(job.tenant_id)}
    if job.kind == FlushJob.Kind.L3_EXPIRE:  # the retention as it is now (a later change wins)
        return {"scope": "l3_expire", "tenant": str(job.tenant_id),
                "retention_seconds": Tenant.objects.values_list("retention_seconds", flat=True).get(pk=job.tenant_id)}
    if job.scope == FlushJob.Scope.TENANT:
        return {"scope": "tenant", "tenant": str(job.tenant_id)}
    if job.scope == FlushJob.Scope.REVISION:
        return {"scope": "revision", "revision": job.revision.label}
    return {"scope": job.scope}


def _save(job: FlushJob, *fields: str) -> None:
    job.heartbeat_at = timezone.now()
    job.save(update_fields=[*fields, "heartbeat_at"])


def _begin(job_id: int) -> FlushJob | None:
    with transaction.atomic():
        job = (FlushJob.objects.select_for_update(of=("self",))
               .select_related("tenant", "deployment", "revision", "from_revision", "adapter").get(pk=job_id))
        if job.is_final:
            return None
        job.attempts += 1
        job.status = FlushJob.Status.RUNNING
        job.started_at = job.started_at or timezone.now()
        _step(job, "attempt", n=job.attempts)
        _save(job, "attempts", "status", "started_at", "steps")
    return job


def job_execute(*, job_id: int, final_attempt: bool = False) -> FlushJob:
    """Run (or resume) job ``job_id`` to a final state. Raises ``RetryLater`` when some workers failed
    and this is not the final attempt (their results stay recorded as failed until a retry succeeds)."""
    job = _begin(job_id)
    if job is None:
        return FlushJob.objects.get(pk=job_id)
    if job.kind in EXECUTORS:
        return EXECUTORS[job.kind](job, final_attempt)
    if job.kind == FlushJob.Kind.ROLLOUT:
        return _execute_rollout(job, final_attempt)
    if job.kind == FlushJob.Kind.SHRED:
        return _execute_shred(job, final_attempt)
    if job.kind == FlushJob.Kind.ADAPTER_DELETE:
        return _execute_adapter_delete(job, final_attempt)
    return _execute_flush(job, final_attempt)


def _execute_adapter_delete(job: FlushJob, final_attempt: bool) -> FlushJob:
    """The adapter's KV flushed on every replica and verified; then the adapter is deleted (its name
    free again). An adapter removed with its deployment meanwhile leaves nothing to do."""
    from controlplane.adapters.models import Adapter

    if job.adapter_id is None:
        _step(job, "adapter_gone")
        return _finish(job, [], True)
    job = _execute_flush(job, final_attempt)
    if job.status == FlushJob.Status.SUCCEEDED:
        Adapter.objects.filter(pk=job.adapter_id).exclude(state=Adapter.State.DELETED).update(
            state=Adapter.State.DELETED, deleted_at=timezone.now())
    return job


def job_fail(*, job_id: int, error: str) -> FlushJob:
    """Record a job that cannot complete (an unexpected error outlived every retry) as failed."""
    with transaction.atomic():
        job = FlushJob.objects.select_for_update(of=("self",)).select_related("tenant").get(pk=job_id)
        if job.is_final:
            return job
        job.status, job.error, job.finished_at = FlushJob.Status.FAILED, error[:2000], timezone.now()
        _step(job, "finished", status=job.status, error=job.error)
        _save(job, "status", "error", "finished_at", "steps")
        audit_record(actor=Actor.system("jobs"), action=f"{job.kind}.complete", target=f"job:{job.pk}",
                     tenant=job.tenant.slug if job.tenant_id else "", new={"status": job.status},
                     reason=job.reason, result="error")
    return job


def _pause() -> None:
    # Test hook: widen the window between workers so a test can kill the Celery worker mid-job.
    delay = float(getattr(settings, "STRATA_JOB_STEP_DELAY", 0) or 0)
    if delay:
        time.sleep(delay)


def _shred_versions(job: FlushJob) -> list[int]:
    """The data-key versions a job shreds: its own (shred), every version of its tenant (offboard)."""
    if job.kind == FlushJob.Kind.SHRED:
        return [job.key_version]
    if job.kind == FlushJob.Kind.OFFBOARD and job.tenant_id:
        return list(DataKey.objects.filter(tenant_id=job.tenant_id).order_by("version")
                    .values_list("version", flat=True))
    return []


def _phases(job: FlushJob) -> int:
    """Calls per worker: rollout stage + switch; flush one; shred one per version (+ the stop of the
    tenant's requests); offboard both."""
    if job.kind == FlushJob.Kind.ROLLOUT:
        return 2
    if job.kind == FlushJob.Kind.MODEL_DELETE:
        return 3  # stop its requests, flush, stop the replica
    versions = len(_shred_versions(job)) + 1  # + cancel_tenant first
    if job.kind == FlushJob.Kind.SHRED:
        return versions
    return 1 + versions if job.kind == FlushJob.Kind.OFFBOARD else 1


def _workers(job: FlushJob) -> list[tuple[ModelDeployment, gateway.WorkerSpec, int]]:
    """Every target replica: (deployment, its spec, replica index)."""
    out = []
    for deployment in _targets(job):
        spec = gateway.spec_for(deployment)
        out += [(deployment, spec, i) for i in gateway.replica_set(spec).indices()]
    return out


def _run_on_workers(job: FlushJob, method: str, args_for, *, key: str = "", **kwargs) -> list[str]:
    """Call ``method`` on every target replica not done yet; record results; return failed names."""
    workers = _workers(job)
    job.progress_total = len(workers) * _phases(job)
    failed = []
    for deployment, spec, replica in workers:
        name = actor_name(deployment.name, replica) + key
        if job.results.get(name, {}).get("status") in DONE:
            continue
        _pause()
        try:
            res = gateway.call(spec, method, *args_for(deployment), create=False, replica=replica,
                               timeout=gateway.CALL_TIMEOUT_S + kwargs.get("drain_seconds", 0), **kwargs)
            res = ({"status": NOT_RUNNING, "blocks_freed": 0, "reason": "not running: nothing to do"}
                   if res is None else {"status": "ok", **res})
        except Unavailable as exc:
            res = {"status": "failed", "reason": exc.message}
            failed.append(name)
        job.results = {**job.results, name: res}
        job.progress_done = sum(1 for r in job.results.values() if r.get("status") in DONE)
        _save(job, "results", "progress_done", "progress_total")
    return failed


def _verify(job: FlushJob, scope: dict) -> tuple[bool, dict[str, dict]]:
    """Probe ``scope`` on every target replica: (all clean, per-replica ``{"ok", ...}``). A replica
    that does not exist holds nothing (``absent``, ok); one that does not answer is not ok. A replica
    whose flush result says ``since`` (when and at which generation it flushed) is asked about what
    was cached before its flush only: the scope's traffic since then is not a failed flush."""
    ok, per_replica = True, {}
    for deployment, spec, replica in _workers(job):
        name = actor_name(deployment.name, replica)
        since = job.results.get(name, {}).get("since")
        asked = {**scope, "since": since} if isinstance(since, dict) else scope
        try:
            probe = gateway.call(spec, "probe", asked, create=False, replica=replica)
        except Unavailable:
            probe = {"ok": False, "reason": "unreachable"}
        if probe is None:
            probe = {"ok": True, "absent": True}
        ok = ok and bool(probe.get("ok"))
        per_replica[name] = probe
    return ok, per_replica


def _finish(job: FlushJob, failed: list[str], verified: bool, figures: dict | None = None) -> FlushJob:
    """Record the job's final state and audit ``<kind>.complete`` with its totals (and ``figures``)."""
    done = [n for n, r in job.results.items() if r.get("status") in DONE]
    if not failed and verified:
        job.status = FlushJob.Status.SUCCEEDED
    elif done:
        job.status = FlushJob.Status.PARTIAL
    else:
        job.status = FlushJob.Status.FAILED
    job.verified = verified
    job.error = "; ".join(f"{n}: {job.results[n].get('reason', '')}" for n in failed)
    job.finished_at = timezone.now()
    _step(job, "finished", status=job.status, verified=verified)
    _save(job, "status", "verified", "error", "finished_at", "steps")
    totals = {"blocks_freed": sum(int(r.get("blocks_freed", 0)) for r in job.results.values()),
              "workers": len(job.results), "failed": failed}
    if job.kind in (FlushJob.Kind.SHRED, FlushJob.Kind.OFFBOARD):
        totals["versions"] = _shred_versions(job)
        drops = [r for n, r in job.results.items() if ":drop:" in n]
        totals["objects_deleted"] = sum(int(r.get("objects", 0)) for r in drops)
        totals["bytes_deleted"] = sum(int(r.get("bytes", 0)) for r in drops)
    if job.kind in (FlushJob.Kind.L3_DELETE, FlushJob.Kind.L3_EXPIRE, FlushJob.Kind.ADAPTER_DELETE):
        totals["objects_deleted"] = sum(int(r.get("tiers", {}).get("l3", 0)) for r in job.results.values())
        totals["bytes_deleted"] = sum(int(r.get("l3_bytes", 0)) for r in job.results.values())
    totals.update(figures or {})
    audit_record(actor=Actor.system("jobs"), action=f"{job.kind}.complete", target=f"job:{job.pk}",
                 tenant=job.tenant.slug if job.tenant_id else "", new={"status": job.status, **totals},
                 reason=job.reason, result="ok" if job.status == FlushJob.Status.SUCCEEDED else "error")
    return job


def _execute_flush(job: FlushJob, final_attempt: bool) -> FlushJob:
    """Flush the scope on every worker and verify. Offboarding also crypto-shreds every data-key
    version of the tenant: its wrapped keys are deleted first (no worker needed for that), then the
    flush, then every worker drops the keys and their L3 objects, verified per version."""
    if job.kind == FlushJob.Kind.OFFBOARD:
        _destroy_keys(job, _shred_versions(job))
        _stop_requests(job, final_attempt, "tenant offboarded")
    scope = _worker_scope(job)
    failed = _run_on_workers(job, "flush", lambda d: (scope,))
    if failed and not final_attempt:
        raise RetryLater(f"{len(failed)} worker(s) unreachable")
    verified, per_replica = _verify(job, scope)
    _step(job, "verified" if verified else "verify_failed", replicas=per_replica)
    if not verified:
        _retry_unverified(job, final_attempt, {"": per_replica}, "flushing them again")
    if job.kind == FlushJob.Kind.OFFBOARD:
        shred_failed, shred_verified = _shred(job, final_attempt)
        failed, verified = failed + shred_failed, verified and shred_verified
    return _finish(job, failed, verified)


def _retry_unverified(job: FlushJob, final_attempt: bool, probes: dict[str | None, dict[str, dict]],
                      what: str) -> None:
    """A verification that failed is retried while attempts are left, not recorded at once: a replica
    that did not answer the probe, or whose backend (L3) did not, is a passing fault that a later
    attempt gets past. ``probes`` maps the result key suffix of the phase each probe checks (``""``
    for a flush, ``":drop:v<n>"`` for a shred; None: a phase not to redo) to the per-replica probes.
    Each replica whose probe was not ok has that phase's result cleared, so the retry does it there
    again (idempotent) before it verifies again: a replica that was not running when the job reached
    it but started and cached the scope meanwhile, or one that still holds what the phase should have
    removed. The last attempt records what still fails (``partial``)."""
    unverified = {(suffix, name) for suffix, per_replica in probes.items()
                  for name, probe in per_replica.items() if not probe.get("ok")}
    if final_attempt or not unverified:
        return
    cleared = {name + suffix for suffix, name in unverified if suffix is not None}
    job.results = {name: r for name, r in job.results.items() if name not in cleared}
    replicas = sorted({name for _, name in unverified})
    _step(job, "verify_retry", replicas=replicas, redo=sorted(cleared))
    _save(job, "results", "steps")
    raise RetryLater(f"{len(replicas)} replica(s) not verified: {what}")


def _destroy_keys(job: FlushJob, versions: list[int]) -> None:
    """Step 1: the wrapped keys go, with their audit events and the job's step, in one transaction."""
    with transaction.atomic():
        destroyed = data_key_destroy(actor=Actor.system("jobs"), tenant=job.tenant, versions=versions,
                                     reason=job.reason, job=job.pk)
        if destroyed or not any(s.get("step") == "keys_deleted" for s in job.steps):
            _step(job, "keys_deleted", versions=destroyed)
            _save(job, "steps")


def _wait_for_caches(job: FlushJob) -> None:
    """Let every web process's cached data-key set expire, so none still hands the key out."""
    ttl = float(getattr(settings, "STRATA_DATA_KEY_CACHE_SECONDS", 2.0))
    shredded = DataKey.objects.filter(tenant_id=job.tenant_id, version__in=_shred_versions(job)).aggregate(
        latest=Max("shredded_at"))["latest"]
    if shredded is not None and ttl > 0:
        remaining = ttl - (timezone.now() - shredded).total_seconds()
        if remaining > 0:
            time.sleep(min(remaining, ttl))


def _shred(job: FlushJob, final_attempt: bool) -> tuple[list[str], bool]:
    """Steps 1-3 of crypto-shredding the job's versions. Returns (failed worker results, verified)."""
    versions = _shred_versions(job)
    _destroy_keys(job, versions)
    if not versions:
        return [], True
    _wait_for_caches(job)
    tenant, failed = str(job.tenant_id), []
    for version in versions:
        scope = {"tenant": tenant, "version": version}
        failed += _run_on_workers(job, "drop_data_key", lambda d, scope=scope: (scope,), key=f":drop:v{version}")
    if failed and not final_attempt:
        raise RetryLater(f"{len(failed)} worker(s) did not drop the key")
    _step(job, "keys_dropped", versions=versions)
    probes = {v: _verify(job, {"scope": "key_version", "tenant": tenant, "version": v}) for v in versions}
    verified = all(ok for ok, _ in probes.values())
    _step(job, "keys_verified" if verified else "keys_verify_failed", versions=versions,
          replicas={f"v{v}": per_replica for v, (_, per_replica) in probes.items()})
    if not verified:
        _retry_unverified(job, final_attempt, {f":drop:v{v}": per_replica for v, (_, per_replica) in probes.items()},
                          "dropping the key there again")
    return failed, verified


def _stop_requests(job: FlushJob, final_attempt: bool, why: str) -> None:
    """Before an offboard or shred goes on (and so before it reports success), every replica stops
    the tenant's running and waiting requests (``cancel_tenant``, recorded per worker as
    ``<actor>:cancel``), so no stream keeps generating, or writing KV, after its tenant or key is gone."""
    tenant = str(job.tenant_id)
    failed = _run_on_workers(job, "cancel_tenant", lambda d: (tenant,), key=":cancel", reason=why)
    if failed and not final_attempt:
        raise RetryLater(f"{len(failed)} worker(s) could not stop the tenant's requests")
    if not any(s.get("step") == "requests_stopped" for s in job.steps):
        _step(job, "requests_stopped", failed=failed)
        _save(job, "steps")


def _execute_shred(job: FlushJob, final_attempt: bool) -> FlushJob:
    _stop_requests(job, final_attempt, "data key shredded")
    failed, verified = _shred(job, final_attempt)
    return _finish(job, failed, verified)


def _execute_rollout(job: FlushJob, final_attempt: bool) -> FlushJob:
    """Stage the new weights on every worker, switch the active revision atomically, then switch each
    worker (old hits stop, running old requests drain or are aborted, old pages freed), and verify
    that the old revision's namespace misses everywhere."""
    new, old = job.revision, job.from_revision
    revision = gateway.revision_source(new)
    failed = _run_on_workers(job, "stage_revision", lambda d: (revision,), key=":stage")
    if failed:
        if not final_attempt:
            raise RetryLater("staging failed on some workers")
        return _finish(job, failed, False)
    deployment = ModelDeployment.objects.get(pk=job.deployment_id)
    if deployment.active_revision_id != new.pk:
        model_activate_revision(actor=Actor.system("rollout"), deployment=deployment, revision=new, reason=job.reason)
        _step(job, "switched", revision=new.label)
        _save(job, "steps")
    drain = float(getattr(settings, "STRATA_ROLLOUT_DRAIN_SECONDS", DRAIN_SECONDS))
    failed = _run_on_workers(job, "switch_revision", lambda d: (new.label,), key=":switch",
                             drain_seconds=drain)
    if failed and not final_attempt:
        raise RetryLater("switch failed on some workers")
    verified, per_replica = True, {}
    if old is not None:
        verified, per_replica = _verify(job, {"scope": "revision", "revision": old.label})
    _step(job, "verified" if verified else "verify_failed", old=old.label if old else None, replicas=per_replica)
    if not verified:  # a switched worker does not switch again: the probe alone is retried
        _retry_unverified(job, final_attempt, {None: per_replica}, "verifying again")
    return _finish(job, failed, verified)

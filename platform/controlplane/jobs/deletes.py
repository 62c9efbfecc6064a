"""Deleting a model or one of its revisions: the request (the row hidden at once, a job queued) and
the job that removes what it left (``model_delete``, ``revision_delete``), registered in
``services.EXECUTORS``. Idempotent and resumable like every job: each replica's result is recorded
as soon as it is known, a retry skips what is done, the last attempt records what still fails.

``model_delete`` (scope model), in this order:

1. every replica stops the model's running and waiting requests (``cancel_tenant`` for each tenant
   granted it; results ``<actor>:cancel``): their streams end with a retryable ``request_stopped``;
2. every running replica flushes scope ``model`` (L1, L2 and its L3 objects; results ``<actor>``),
   verified by ``probe``;
3. every replica is drained and stopped (``ReplicaSet.drain``: its actor killed, and with it the
   engine's child processes, vLLM's engine core included; results ``<actor>:stop``), up to
   ``MAX_REPLICAS``, and no Ray actor named ``cache-worker:<model>:*`` may be left (step
   ``replicas_stopped``);
4. the model's L3 objects still in the store (where no replica ran, or written after a flush) are
   deleted from here (``jobs.model_l3``), and it must hold none, nor any byte of them on disk
   (step ``l3_deleted``);
5. its grants end (``grant.delete`` each, audited; step ``grants_ended``), and its LoRA adapters
   (tenants stopped resolving them when the model was marked deleted; step ``adapters_ended``);
6. succeeded: the name is free again (``purged_at``). ``model_delete.complete`` carries the figures:
   objects and bytes deleted, blocks freed, replicas stopped, grants, adapters and named caches ended.

``revision_delete`` (scope revision): every replica flushes the revision (every tier), verified, then
its L3 objects left in the store are deleted from here as in step 4, its adapters' (``<revision>~...``)
included.

A second DELETE of a model being deleted answers the same job while it runs, and queues a new one
after a job that ended ``partial`` or ``failed`` (a retry); once one succeeded, the name is a 404.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cachecore.errors import BackendUnavailable
from controlplane.audit.services import audit_record
from controlplane.caches.services import caches_forget_deployment
from controlplane.common.actor import Actor
from controlplane.common.errors import Conflict, InvalidInput, Unavailable
from controlplane.jobs import model_l3, services
from controlplane.jobs.models import FlushJob
from controlplane.jobs.services import (
    DONE,
    EXECUTORS,
    NOT_RUNNING,
    RetryLater,
    _describe,
    _finish,
    _missing,
    _retry_unverified,
    _run_on_workers,
    _save,
    _step,
    _verify,
    _workers,
)
from controlplane.registry.deletes import model_mark_deleted, model_mark_purged, revision_mark_deleted
from controlplane.registry.models import ModelDeployment
from controlplane.runtime import gateway
from controlplane.runtime.replicas import MAX_REPLICAS
from controlplane.tenants.access import grant_delete
from controlplane.tenants.models import Grant
from workers import replica_board
from workers.actor import NAMESPACE, actor_name

logger = logging.getLogger("controlplane.jobs")

CANCEL_WAIT_S = 5.0  # how long a replica waits for one tenant's stopped requests to release their blocks
ACTORS_GONE_S = 30.0  # how long a killed replica's actor may take to leave Ray's directory
JOBS = Actor.system("jobs")


def _reason(reason: str | None) -> str:
    reason = (reason or "").strip()
    if not reason:
        raise InvalidInput("a reason is required", code="reason_required")
    return reason


def _confirmed(model: str, confirm: str | None) -> None:
    """The console asks for the model's name typed (``confirm``); the admin API does not (None)."""
    if confirm is not None and confirm.strip() != model:
        raise Conflict(f"type the model's name {model!r} to confirm", code="delete_not_confirmed")


def _create(actor: Actor, kind: str, scope: str, reason: str, deployment, revision=None, **step) -> FlushJob:
    job = FlushJob.objects.create(kind=kind, scope=scope, deployment=deployment, revision=revision, reason=reason,
                                  requested_by=actor.name, auth_method=actor.auth_method)
    _step(job, "requested", by=actor.name, **step)
    job.save(update_fields=["steps"])
    audit_record(actor=actor, action=f"{kind}.request", target=f"job:{job.pk}", new=_describe(job), reason=reason)
    services._enqueue(job)  # through the module: tests run the job themselves
    return job


def model_delete_request(*, actor: Actor, model: str, reason: str, confirm: str | None = None) -> FlushJob:
    """Delete deployment ``model``: hidden from everyone at once (tenants get 404 ``model_not_found``,
    lists leave it out), its named caches ended, and a ``model_delete`` job queued (module docstring).
    A model already being deleted: its running job, or a new one after a job that did not succeed.
    Raises InvalidInput (no reason), Conflict (``confirm`` given and not the name), NotFound."""
    reason = _reason(reason)
    _confirmed(model, confirm)
    with transaction.atomic():
        deployment = model_mark_deleted(actor=actor, name=model, reason=reason)
        running = (FlushJob.objects.filter(kind=FlushJob.Kind.MODEL_DELETE, deployment=deployment)
                   .exclude(status__in=FlushJob.FINAL).order_by("-pk").first())
        if running is not None:
            return running
        ended = caches_forget_deployment(deployment)
        return _create(actor, FlushJob.Kind.MODEL_DELETE, FlushJob.Scope.MODEL, reason, deployment,
                       named_caches_ended=ended)


def revision_delete_request(*, actor: Actor, model: str, revision: str, reason: str,
                            confirm: str | None = None) -> FlushJob:
    """Delete revision ``revision`` of ``model`` (not the active one: 409 ``revision_active``; nor one
    a rollout still in progress goes to or from: 409 ``revision_in_rollout``): no longer listed nor
    rolled out to, and a ``revision_delete`` job queued that removes its KV from every tier."""
    reason = _reason(reason)
    _confirmed(model, confirm)
    with transaction.atomic():
        deployment = ModelDeployment.objects.filter(name=model).first() or _missing("model", model)
        rollouts = FlushJob.objects.filter(kind=FlushJob.Kind.ROLLOUT, deployment=deployment).exclude(
            status__in=FlushJob.FINAL)
        if any(label == revision for j in rollouts.select_related("revision", "from_revision")
               for label in (j.revision.label if j.revision_id else None,
                             j.from_revision.label if j.from_revision_id else None)):
            raise Conflict(f"a rollout of {model!r} to or from {revision!r} is in progress; wait until it ends",
                           code="revision_in_rollout")
        rev = revision_mark_deleted(actor=actor, deployment=deployment, label=revision, reason=reason)
        return _create(actor, FlushJob.Kind.REVISION_DELETE, FlushJob.Scope.REVISION, reason, deployment, rev)


# ---------------------------------------------------------------------- execution
def _granted_tenants(job: FlushJob) -> list[str]:
    return [str(t) for t in Grant.objects.filter(deployment_id=job.deployment_id).values_list("tenant_id", flat=True)]


def _stop_requests(job: FlushJob, final_attempt: bool) -> None:
    """Step 1: on every replica, every granted tenant's running and waiting requests stop."""
    tenants = _granted_tenants(job)
    failed = []
    for deployment, spec, replica in _workers(job):
        name = actor_name(deployment.name, replica) + ":cancel"
        if job.results.get(name, {}).get("status") in DONE:
            continue
        res: dict = {"status": "ok", "cancelled": 0, "remaining": 0}
        try:
            for tenant in tenants:
                out = gateway.call(spec, "cancel_tenant", tenant, reason="model deleted", wait_seconds=CANCEL_WAIT_S,
                                   create=False, replica=replica, timeout=gateway.CALL_TIMEOUT_S + CANCEL_WAIT_S)
                if out is None:
                    res = {"status": NOT_RUNNING, "reason": "not running: nothing to do"}
                    break
                res["cancelled"] += int(out.get("cancelled", 0))
                res["remaining"] += int(out.get("remaining", 0))
        except Unavailable as exc:
            res = {"status": "failed", "reason": exc.message}
            failed.append(name)
        job.results = {**job.results, name: res}
        _save(job, "results")
    if failed and not final_attempt:
        raise RetryLater(f"{len(failed)} replica(s) could not stop the model's requests")
    if not any(s.get("step") == "requests_stopped" for s in job.steps):
        _step(job, "requests_stopped", tenants=len(tenants), failed=failed)
        _save(job, "steps")


def _actors_left(model: str) -> list[str]:
    """Names of the Ray actors of ``model``'s replicas still alive (every index, not only configured)."""
    ray = gateway.join()
    prefix = actor_name(model, 0)[: -len("0")]
    deadline = time.monotonic() + ACTORS_GONE_S
    while True:
        left = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def _stop_replicas(job: FlushJob, final_attempt: bool) -> list[str]:
    """Step 3: drain and stop every replica (``ReplicaSet.drain``: its actor killed),
    orphans above the configured count included. Returns the actors still alive (none: done)."""
    deployment = job.deployment
    spec = gateway.spec_for(deployment)
    rs = gateway.replica_set(spec)
    deadline = float(getattr(settings, "STRATA_DRAIN_SECONDS", gateway.DRAIN_SECONDS))
    configured = set(rs.indices())
    try:
        for i in range(MAX_REPLICAS):
            name = actor_name(deployment.name, i) + ":stop"
            if job.results.get(name, {}).get("status") in DONE:
                continue
            res = rs.drain(i, deadline_s=deadline)
            if res["status"] == "absent" and i not in configured:
                continue  # no replica was ever there: no row
            job.results = {**job.results, name: {
                "status": "ok" if res["status"] == "stopped" else NOT_RUNNING,
                "stopped": res["status"] == "stopped", "running_at_kill": res.get("running_at_kill", 0)}}
            job.progress_done = sum(1 for r in job.results.values() if r.get("status") in DONE)
            _save(job, "results", "progress_done")
        left = _actors_left(deployment.name)
    except Exception as exc:  # Ray unreachable: nothing can be stopped now
        if not final_attempt:
            raise RetryLater(f"replicas could not be stopped: {exc!r}") from exc
        left = [f"unknown: {type(exc).__name__}"]
    gateway.forget(deployment.name)
    if not left:  # its replicas' states go with it: a model created again under the name starts with none
        replica_board.forget(actor_name(deployment.name, 0)[:-1])
    if left and not final_attempt:  # started again meanwhile (a request that resolved before the delete)
        job.results = {n: r for n, r in job.results.items() if n.removesuffix(":stop") not in left}
        _save(job, "results")
        raise RetryLater(f"replica actors still alive: {', '.join(left)}")
    stopped = sum(1 for n, r in job.results.items() if n.endswith(":stop") and r.get("stopped"))
    _step(job, "replicas_stopped", stopped=stopped, left=left)
    _save(job, "steps")
    return left


def _purge_l3(job: FlushJob, final_attempt: bool, revision: str | None = None) -> bool:
    """Step 4: the scope's L3 objects left in the store are deleted from here; True when none is left,
    listed or on disk."""
    try:
        res = model_l3.purge(model=job.deployment.name, revision=revision)
    except (BackendUnavailable, OSError, ValueError) as exc:
        if not final_attempt:
            raise RetryLater(f"the L3 store could not be reached: {exc}") from exc
        res = {"error": f"{type(exc).__name__}: {exc}", "objects": 0, "bytes": 0, "left_objects": None}
    _step(job, "l3_deleted", **res)
    _save(job, "steps")
    return res.get("left_objects") == 0 and res.get("left_disk_bytes") == 0


def _end_grants(job: FlushJob) -> int:
    """Step 5: every grant of the model ends (``grant.delete`` each, audited)."""
    ended = []
    for grant in Grant.objects.filter(deployment_id=job.deployment_id).select_related("tenant"):
        grant_delete(actor=JOBS, tenant=grant.tenant, deployment=job.deployment)
        ended.append(grant.tenant.slug)
    _step(job, "grants_ended", tenants=ended)
    _save(job, "steps")
    return len(ended)


def _end_adapters(job: FlushJob) -> int:
    """Step 6: the model's LoRA adapters end with it (their KV went with the model's: every tier of
    scope model, their ``<revision>~<adapter>`` L3 objects included); their names are free again."""
    from controlplane.adapters.models import Adapter

    ended = list(Adapter.objects.filter(deployment_id=job.deployment_id).exclude(state=Adapter.State.DELETED)
                 .values_list("name", flat=True))
    Adapter.objects.filter(deployment_id=job.deployment_id, name__in=ended).update(
        state=Adapter.State.DELETED, deleted_at=timezone.now())
    _step(job, "adapters_ended", adapters=ended)
    _save(job, "steps")
    return len(ended)


def _figures(job: FlushJob) -> dict:
    """What the job removed, over every attempt: the replicas' flushes plus the steps recorded here."""
    flushes = [r for n, r in job.results.items() if n.count(":") == 2]  # cache-worker:<model>:<i>, no phase
    l3_steps = [s for s in job.steps if s.get("step") == "l3_deleted"]
    requested = next((s for s in job.steps if s.get("step") == "requested"), {})
    return {
        "objects_deleted": sum(int(r.get("tiers", {}).get("l3", 0)) for r in flushes)
        + sum(int(s.get("objects", 0)) for s in l3_steps),
        "bytes_deleted": sum(int(r.get("l3_bytes", 0)) for r in flushes)
        + sum(int(s.get("bytes", 0)) for s in l3_steps),
        "disk_bytes_freed": sum(int(s.get("disk_bytes", 0)) for s in l3_steps),
        "replicas_stopped": sum(1 for n, r in job.results.items() if n.endswith(":stop") and r.get("stopped")),
        "grants_ended": sum(len(s.get("tenants", ())) for s in job.steps if s.get("step") == "grants_ended"),
        "adapters_ended": sum(len(s.get("adapters", ())) for s in job.steps if s.get("step") == "adapters_ended"),
        "named_caches_ended": int(requested.get("named_caches_ended", 0)),
    }


def _flush_verified(job: FlushJob, scope: dict, final_attempt: bool) -> tuple[list[str], bool]:
    """Step 2: flush ``scope`` on every running replica and verify it misses there."""
    failed = _run_on_workers(job, "flush", lambda d: (scope,))
    if failed and not final_attempt:
        raise RetryLater(f"{len(failed)} worker(s) unreachable")
    verified, per_replica = _verify(job, scope)
    _step(job, "verified" if verified else "verify_failed", replicas=per_replica)
    _save(job, "steps")
    if not verified:
        _retry_unverified(job, final_attempt, {"": per_replica}, "flushing them again")
    return failed, verified


def execute_model_delete(job: FlushJob, final_attempt: bool) -> FlushJob:
    _stop_requests(job, final_attempt)
    _flush_verified(job, {"scope": "model"}, final_attempt)
    left = _stop_replicas(job, final_attempt)
    l3_clean = _purge_l3(job, final_attempt)
    _end_grants(job)
    _end_adapters(job)
    # Every replica gone (its L1 and L2 with it) and no L3 object left: nothing of the model remains,
    # whatever a replica that did not answer its flush held.
    verified = not left and l3_clean
    if verified:
        model_mark_purged(deployment=job.deployment)
    return _finish(job, [] if verified else [n for n, r in job.results.items() if r.get("status") == "failed"],
                   verified, _figures(job))


def execute_revision_delete(job: FlushJob, final_attempt: bool) -> FlushJob:
    failed, verified = _flush_verified(job, {"scope": "revision", "revision": job.revision.label}, final_attempt)
    l3_clean = _purge_l3(job, final_attempt, revision=job.revision.label)
    return _finish(job, failed, verified and l3_clean, _figures(job))


EXECUTORS[FlushJob.Kind.MODEL_DELETE] = execute_model_delete
EXECUTORS[FlushJob.Kind.REVISION_DELETE] = execute_revision_delete

"""Gateway from Django processes (web, Celery) to the cache-worker Ray actors: the one API the rest of
the control plane calls (``call``, ``acall`` and its thread-side start ``submit``, ``astream``,
``cancel_request``, ``cancel_tenant``,
``apply_scale``, ``spec_for``...). Its halves: ``runtime.cluster`` (joining Ray, specs, the replica directory, worker
errors) and ``runtime.dispatch`` (serving calls: replica choice and failover).

Ray is joined lazily on first use, and only joined, never started: ``STRATA_RAY_ADDRESS``
(``RAY_ADDRESS``; the launcher sets it for its children), or a Ray this process already initialised
(tests). With neither, every call is ``Unavailable``: a web or Celery process must not quietly start
a Ray cluster of its own. Every blocking Ray call runs in a thread so the ASGI event loop never
stalls; object refs are awaited natively.

Replicas: a deployment's replicas live in one ``ReplicaSet`` per process (``replica_set``). Requests
(``collect``, ``complete``, ``stream``) go where the deployment's ``Router`` says; KV API calls of a
tenant go to one replica chosen from the tenant id (uploads and lookups meet); other methods to the
first routable replica, or to ``replica=i`` when given (the jobs and the stats address each one).

Failover: a replica that cannot be reached leaves routing at once and, on the serving path, is
re-launched in the background and put back when it answers. A request that failed that way before
anything was streamed is retried once on another routable replica; a stream that broke later ends
with a retryable ``error`` event.

Errors: a worker that cannot be reached (actor dead or unavailable, timeout, connection lost) is
``Unavailable`` (503 with Retry-After) and its cached handle is dropped (a dead or unavailable actor,
or a lost connection, also marks the replica dead). An error the actor method
itself raised (``RayTaskError``) means the actor is alive and refused this request: a cachecore
``CacheError`` keeps its code (4xx, or 503 for transient states such as ``out_of_blocks``), a
``ValueError``/``TypeError``-like cause is 422 ``invalid_request``, anything else 503
``worker_failed``; the handle is kept. Never a hang or a 500.

Cancellation: when the awaiting coroutine is cancelled (Django cancels the view when the client
disconnects) or a stream is closed early, the request is cancelled on its worker
(``cancel(request_id)``, fire-and-forget) so it stops at its next step and releases its blocks.
"""

from __future__ import annotations

import logging
import threading

from django.conf import settings

from controlplane.common.errors import Unavailable
from controlplane.runtime.cluster import (  # noqa: F401  (the gateway's API, used across the control plane)
    CALL_TIMEOUT_S,
    CREATE_TIMEOUT_S,
    GENERATION_TIMEOUT_S,
    WorkerSpec,
    cancel_remote,
    forget,
    get_worker,
    join,
    known_set,
    replica_set,
    request_id_of,
    revision_source,
    router,
    spec_for,
    worker_error,
    workers_ready,
)
from controlplane.runtime.dispatch import (  # noqa: F401
    Started,
    abandon,
    acall,
    astream,
    held,
    start_wait_s,
    stopped,
    submit,
    unreachable,
)

logger = logging.getLogger("controlplane.runtime")

DRAIN_SECONDS = 30.0  # default deadline for a scaled-away replica's running requests
_ray = join  # the module-level name tests and benchmarks use


def call(spec: WorkerSpec, method: str, *args, timeout: float = CALL_TIMEOUT_S, create: bool = True,
         replica: int | None = None, **kwargs):
    """Blocking call of an actor method (Celery tasks, management commands, stats). ``replica``: that
    replica (None when it does not exist and not ``create``); None: the first routable replica. Every
    failure is ``Unavailable`` (what the jobs expect); the handle is dropped only when the worker was
    unreachable, not when the method itself raised."""
    rs = replica_set(spec)
    if replica is None:
        if rs.count == 0:
            raise stopped(spec)
        if (error := held(spec)) is not None:
            raise error
        reps = rs.routable()
        if not reps:
            raise Unavailable(f"no replica of {spec.deployment} is available; retry shortly", retry_after=5)
        replica = reps[0].index
    handle = get_worker(spec, create=create, replica=replica)
    if handle is None:
        return None
    try:
        return _ray().get(getattr(handle, method).remote(*args, **kwargs), timeout=timeout)
    except Exception as exc:
        refused = worker_error(spec, exc)
        if refused is not None:
            raise Unavailable(f"worker {spec.deployment} failed {method}: {refused.message}", retry_after=5) from exc
        unreachable(spec, rs, rs.replica(replica), exc, revive=create)
        raise Unavailable(f"worker {spec.deployment} did not answer {method}", retry_after=5) from exc


def cancel_request(spec: WorkerSpec, request_id: str) -> None:
    """Fire-and-forget cancel of ``request_id`` on its worker, from any thread (a response closer):
    the replica it was dispatched to, or every known replica when this process no longer tracks it.
    A request that already ended is not affected. Never raises, never waits."""
    rs = known_set(spec.deployment)
    if rs is None:
        return
    rep = rs.where(request_id)
    handles = [rep.handle] if rep is not None else [rs.cached(i) for i in rs.indices()]
    for handle in handles:
        if handle is not None:
            cancel_remote(spec, handle, request_id)


def apply_scale(spec: WorkerSpec, *, wait: bool = False) -> dict | None:
    """Bring ``spec``'s deployment to ``spec.replicas`` running replicas: missing ones are started,
    replicas beyond the count drained (out of routing now; killed once their running requests ended,
    at the latest after ``STRATA_DRAIN_SECONDS``; their engines shut down, then their actors killed).
    ``spec.replicas == 0`` stops the deployment: every replica drains. In a background thread unless
    ``wait`` (then the ``ReplicaSet.scale`` result). Without a reachable Ray it logs and does nothing: the replicas
    start on the next request instead."""
    deadline = float(getattr(settings, "STRATA_DRAIN_SECONDS", DRAIN_SECONDS))
    rs = replica_set(spec)

    def run() -> dict | None:
        try:
            return rs.scale(deadline_s=deadline)
        except Exception as exc:
            logger.warning("scaling %s to %d replicas did not complete: %r", spec.deployment, spec.replicas, exc)
            return None

    if wait:
        return run()
    threading.Thread(target=run, name=f"scale-{spec.deployment}", daemon=True).start()
    return None


CANCEL_TENANT_TIMEOUT_S = CALL_TIMEOUT_S + 15.0  # the worker waits up to 10 s for blocks to be released


def cancel_tenant(tenant_id: int | str, *, reason: str) -> dict:
    """Blocking: stop every running or waiting request of tenant ``tenant_id`` on every replica of
    every deployment with an active revision (``CacheWorker.cancel_tenant``), before a suspension,
    an offboarding or a key shred reports success. Returns ``{"replicas": {actor name: the worker's
    result, or {"absent": True}}, "failed": [actor names that could not be reached]}``. Without any
    Ray cluster configured no worker can run anything: ``{"replicas": {}, "failed": [], "skipped":
    reason}``. Never raises; the callers decide what a failure means."""
    from controlplane.registry.models import ModelDeployment
    from workers.actor import actor_name

    out: dict = {"replicas": {}, "failed": []}
    if not _ray_configured():
        out["skipped"] = "no Ray cluster configured"
        return out
    deployments = ModelDeployment.objects.select_related("active_revision").filter(active_revision__isnull=False)
    for deployment in deployments.order_by("name"):
        spec = spec_for(deployment)
        for replica in replica_set(spec).indices():
            name = actor_name(deployment.name, replica)
            try:
                res = call(spec, "cancel_tenant", str(tenant_id), reason=reason, create=False, replica=replica,
                           timeout=CANCEL_TENANT_TIMEOUT_S)
            except Unavailable as exc:
                logger.warning("could not stop tenant %s's requests on %s: %s", tenant_id, name, exc.message)
                out["failed"].append(name)
                continue
            out["replicas"][name] = {"absent": True} if res is None else res
    return out


def _ray_configured() -> bool:
    import ray

    return ray.is_initialized() or bool(getattr(settings, "STRATA_RAY_ADDRESS", None))

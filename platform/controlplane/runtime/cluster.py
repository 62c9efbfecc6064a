"""Joining Ray and finding a deployment's replicas, for the gateway (``controlplane.runtime.gateway``
is the API the rest of the control plane calls; this module is its lower half).

Ray is joined lazily on first use, and only joined, never started: ``STRATA_RAY_ADDRESS``
(``RAY_ADDRESS``; the launcher sets it for its children), or a Ray this process already initialised
(tests). With neither, every call is ``Unavailable``: a web or Celery process must not quietly start
a Ray cluster of its own.

A deployment's replicas live in one ``ReplicaSet`` per process (``replica_set``), with one
``Router`` (``router_of``). ``worker_error`` tells a request the actor refused (it is alive) from a
worker that could not be reached.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from cachecore.errors import CacheError
from controlplane.common.errors import ApplicationError, Unavailable, WorkerError
from controlplane.runtime.replicas import ReplicaSet
from controlplane.runtime.router import Router, drop_router, router_for

logger = logging.getLogger("controlplane.runtime")
_JOIN_LOCK = threading.Lock()  # join(): one ray.init per process

CALL_TIMEOUT_S = 30.0
GENERATION_TIMEOUT_S = 600.0  # a whole non-streamed generation (long outputs on a CPU)
CREATE_TIMEOUT_S = 120.0
# A vLLM replica loads its weights and may compile before it answers (minutes for a large checkpoint):
# it gets as long as the worker gives its engine (``workers.vllm_worker.START_TIMEOUT_S``), so a slow
# start is waited for, never taken for a dead replica and restarted from scratch.
VLLM_CREATE_TIMEOUT_S = 900.0
_BAD_INPUT = (ValueError, TypeError, ArithmeticError, LookupError)  # bad values the worker refused
_lock = threading.Lock()
_sets: dict[str, ReplicaSet] = {}


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker for one deployment is started with (from the registry's active revision)."""

    deployment: str
    preset: str
    revision: dict  # {"label"} and one of "seed", "weights_path", "checkpoint_path"
    replicas: int = 1
    engine: str = "strata"  # "strata" | "vllm" (registry.engines)
    tensor_parallel_size: int = 1  # devices of one replica (vllm only)
    deployment_id: int | None = None  # the registry row: a name deleted and created again is another one
    # (error code, message) while the revision may not serve (its weights digest is not known yet, or
    # hashing them failed: hashing.selectors.hold); no replica starts for it, requests get that 503
    unservable: tuple[str, str] | None = None


def revision_source(rev) -> dict:
    """The worker's ``revision`` dict of a registry ``ModelRevision``. A checkpoint revision carries the
    digest recorded at its creation: a worker refuses a directory whose bytes changed since."""
    if rev.checkpoint_path:  # ``lora``: what a vLLM engine on it starts LoRA with (the reference engine ignores it)
        return {"label": rev.label, "checkpoint_path": rev.checkpoint_path, "digest": rev.digest,
                "lora": {"max_loras": int(getattr(settings, "STRATA_LORA_MAX_LORAS", 0)),
                         "max_lora_rank": int(getattr(settings, "STRATA_LORA_MAX_RANK", 16))}}
    if rev.weights_path:
        return {"label": rev.label, "weights_path": rev.weights_path}
    return {"label": rev.label, "seed": rev.seed}


def spec_for(deployment) -> WorkerSpec:
    """The worker spec of a registry ``ModelDeployment`` at its active revision (held while that
    revision's digest is pending: ``unservable``)."""
    from controlplane.hashing.selectors import hold

    rev = deployment.active_revision
    return WorkerSpec(deployment=deployment.name, preset=deployment.preset,
                      revision=revision_source(rev), replicas=deployment.replicas,
                      engine=deployment.engine, tensor_parallel_size=deployment.tensor_parallel_size,
                      deployment_id=deployment.pk, unservable=hold(rev))


def join():
    """The ``ray`` module, joined to the cluster at ``STRATA_RAY_ADDRESS`` (or the Ray this process
    already initialised). Never starts a local Ray: without an address it raises ``Unavailable``."""
    import ray

    if not ray.is_initialized():
        address = getattr(settings, "STRATA_RAY_ADDRESS", None)
        if not address:
            raise Unavailable("cache workers unavailable: no Ray cluster configured (RAY_ADDRESS unset)",
                              retry_after=5)
        # One thread joins: ray.init from two threads at once fails in the second ("Perhaps you called
        # ray.init twice by accident?"), which the first requests after a start would answer with 503.
        with _JOIN_LOCK:
            if not ray.is_initialized():
                ray.init(address=address, namespace="strata", ignore_reinit_error=True, log_to_driver=False)
    return ray


def request_id_of(args: tuple) -> str | None:
    """The ``request_id`` of the request dict passed first in ``args`` (None when there is none)."""
    req = args[0] if args else None
    rid = req.get("request_id") if isinstance(req, dict) else None
    return rid if isinstance(rid, str) and rid else None


def cancel_remote(spec: WorkerSpec, handle: Any, request_id: str | None, ref: Any = None) -> None:
    """Fire-and-forget: tell the worker to stop ``request_id`` and free its blocks; cancel ``ref`` (the
    task or streaming generator) too, which drops it if it is still queued behind other requests (a
    running threaded-actor task is only flagged, never interrupted). Never raises, never waits."""
    if request_id is not None:
        try:
            handle.cancel.remote(request_id)
        except Exception as exc:
            logger.warning("could not cancel %s on %s: %r", request_id, spec.deployment, exc)
    if ref is not None:
        try:
            import ray

            if ray.is_initialized():
                ray.cancel(ref, recursive=False)
        except Exception as exc:
            logger.debug("ray.cancel of %s on %s failed: %r", request_id, spec.deployment, exc)


def worker_error(spec: WorkerSpec, exc: BaseException) -> ApplicationError | None:
    """The API error for an exception the actor method raised itself (``RayTaskError``: the actor is
    alive and refused this request), or None when ``exc`` means the worker could not be reached."""
    from ray.exceptions import RayTaskError

    if not isinstance(exc, RayTaskError):
        return None
    cause = exc.cause
    if isinstance(cause, CacheError):
        logger.info("worker %s refused a request: %s (%s)", spec.deployment, cause.code, cause)
        return WorkerError(str(cause) or cause.code, code=cause.code)
    if isinstance(cause, _BAD_INPUT):
        logger.info("worker %s refused a request: %r", spec.deployment, cause)
        return WorkerError(f"invalid request: {str(cause)[:300] or type(cause).__name__}", code="invalid_request")
    logger.warning("worker %s failed on a request: %s", spec.deployment, exc)
    return WorkerError("the cache worker failed on this request", code="worker_failed")


def registry_spec(deployment: str) -> WorkerSpec | None:
    """The registry's current spec of ``deployment`` (None: gone or no active revision), read on this
    thread's own database connection, closed after (revival threads call it)."""
    from django.db import connection

    from controlplane.registry.models import ModelDeployment

    try:
        row = (ModelDeployment.objects.select_related("active_revision")
               .filter(name=deployment, active_revision__isnull=False).first())
        return spec_for(row) if row is not None else None
    finally:
        connection.close()


def replica_set(spec: WorkerSpec) -> ReplicaSet:
    """This process's directory of ``spec``'s replicas, updated to ``spec`` (count, revision). A name
    that now belongs to another deployment (deleted and created again) starts a new directory: the
    old one's handles name actors its delete job killed."""
    rs = _sets.get(spec.deployment)
    if rs is not None and None not in (spec.deployment_id, getattr(rs.spec, "deployment_id", None)) \
            and rs.spec.deployment_id != spec.deployment_id:
        forget(spec.deployment)
        rs = None
    if rs is None:
        with _lock:
            rs = _sets.get(spec.deployment)
            if rs is None:
                rs = _sets[spec.deployment] = ReplicaSet(
                    spec.deployment, join=join,
                    create_timeout=VLLM_CREATE_TIMEOUT_S if spec.engine == "vllm" else CREATE_TIMEOUT_S,
                    refresh=lambda name=spec.deployment: registry_spec(name))
    return rs.update(spec)


def known_set(deployment: str) -> ReplicaSet | None:
    """This process's directory of ``deployment``'s replicas if it has one (never creates one)."""
    return _sets.get(deployment)


def router(spec: WorkerSpec) -> Router:
    """The deployment's router in this process."""
    return router_of(replica_set(spec))


def router_of(rs: ReplicaSet) -> Router:
    """The router of ``rs``'s deployment in this process (its poller joins Ray through ``join``)."""
    return router_for(rs, join=join)


def forget(deployment: str) -> None:
    """Drop every cached handle of a deployment (its workers were replaced or removed): the next
    call looks them up again; background revivals of its replicas stop."""
    with _lock:
        rs = _sets.pop(deployment, None)
    if rs is not None:
        rs.close()
    drop_router(deployment)


def unavailable(spec: WorkerSpec, exc: BaseException) -> Unavailable:
    """The 503 for a worker that could not be found or started (``exc`` is logged, not shown)."""
    logger.warning("worker for %s unavailable: %r", spec.deployment, exc)
    return Unavailable("cache workers are unavailable; retry shortly", retry_after=5)


def get_worker(spec: WorkerSpec, *, create: bool = True, replica: int | None = None) -> Any:
    """Blocking: a handle of ``spec``'s replica ``replica`` (created if absent and ``create``). With
    ``replica=None`` and ``create`` every configured replica is started (in parallel) and the first
    routable one's handle returned; without ``create``, the first routable replica found (or None)."""
    rs = replica_set(spec)
    try:
        if replica is not None:
            return rs.handle(replica, create=create)
        if create:
            handles = rs.start_all()
            ready = rs.routable()
            return ready[0].handle if ready else handles[0]
        for rep in rs.routable():
            handle = rs.handle(rep.index, create=False)
            if handle is not None:
                return handle
        return None
    except Unavailable:
        raise
    except Exception as exc:
        rs.forget(replica)
        raise unavailable(spec, exc) from exc


def workers_ready() -> dict:
    """Readiness: can this process reach Ray? (Actors are created on demand per deployment.)"""
    try:
        import ray as _r

        if not _r.is_initialized() and not getattr(settings, "STRATA_RAY_ADDRESS", None):
            return {"ok": False, "error": "not connected to Ray (RAY_ADDRESS unset)"}
        ray = join()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return {"ok": bool(nodes), "nodes": len(nodes)}
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__}

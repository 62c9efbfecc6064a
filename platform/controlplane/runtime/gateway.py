"""Gateway from Django processes (web, Celery) to the cache-worker Ray actors.

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

import asyncio
import logging
import threading
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from cachecore.errors import CacheError
from controlplane.common.errors import ApplicationError, Unavailable, WorkerError
from controlplane.runtime.replicas import Replica, ReplicaSet, gone
from controlplane.runtime.router import Router, drop_router, router_for

logger = logging.getLogger("controlplane.runtime")

CALL_TIMEOUT_S = 30.0
GENERATION_TIMEOUT_S = 600.0  # a whole non-streamed generation (long outputs on a CPU)
CREATE_TIMEOUT_S = 120.0
DRAIN_SECONDS = 30.0  # default deadline for a scaled-away replica's running requests
CANCELLABLE = frozenset({"collect", "complete"})  # methods whose first argument is a request dict
TENANT_AFFINE = frozenset({"kv_lookup", "kv_store", "kv_retrieve"})  # a tenant's KV calls meet on one replica
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


def revision_source(rev) -> dict:
    """The worker's ``revision`` dict of a registry ``ModelRevision``."""
    if rev.checkpoint_path:
        return {"label": rev.label, "checkpoint_path": rev.checkpoint_path}
    if rev.weights_path:
        return {"label": rev.label, "weights_path": rev.weights_path}
    return {"label": rev.label, "seed": rev.seed}


def spec_for(deployment) -> WorkerSpec:
    """The worker spec of a registry ``ModelDeployment`` at its active revision."""
    return WorkerSpec(deployment=deployment.name, preset=deployment.preset,
                      revision=revision_source(deployment.active_revision), replicas=deployment.replicas)


def _ray():
    """The ``ray`` module, joined to the cluster at ``STRATA_RAY_ADDRESS`` (or the Ray this process
    already initialised). Never starts a local Ray: without an address it raises ``Unavailable``."""
    import ray

    if not ray.is_initialized():
        address = getattr(settings, "STRATA_RAY_ADDRESS", None)
        if not address:
            raise Unavailable("cache workers unavailable: no Ray cluster configured (RAY_ADDRESS unset)",
                              retry_after=5)
        ray.init(address=address, namespace="strata", ignore_reinit_error=True, log_to_driver=False)
    return ray


def request_id_of(args: tuple) -> str | None:
    """The ``request_id`` of the request dict passed first in ``args`` (None when there is none)."""
    req = args[0] if args else None
    rid = req.get("request_id") if isinstance(req, dict) else None
    return rid if isinstance(rid, str) and rid else None


def _cancel_remote(spec: WorkerSpec, handle: Any, request_id: str | None, ref: Any = None) -> None:
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


def cancel_request(spec: WorkerSpec, request_id: str) -> None:
    """Fire-and-forget cancel of ``request_id`` on its worker, from any thread (a response closer):
    the replica it was dispatched to, or every known replica when this process no longer tracks it.
    A request that already ended is not affected. Never raises, never waits."""
    rs = _sets.get(spec.deployment)
    if rs is None:
        return
    rep = rs.where(request_id)
    handles = [rep.handle] if rep is not None else [rs.cached(i) for i in rs.indices()]
    for handle in handles:
        if handle is not None:
            _cancel_remote(spec, handle, request_id)


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


def replica_set(spec: WorkerSpec) -> ReplicaSet:
    """This process's directory of ``spec``'s replicas, updated to ``spec`` (count, revision)."""
    rs = _sets.get(spec.deployment)
    if rs is None:
        with _lock:
            rs = _sets.get(spec.deployment)
            if rs is None:
                rs = _sets[spec.deployment] = ReplicaSet(spec.deployment, join=_ray, create_timeout=CREATE_TIMEOUT_S)
    return rs.update(spec)


def router(spec: WorkerSpec) -> Router:
    """The deployment's router in this process."""
    return _router(replica_set(spec))


def _router(rs: ReplicaSet) -> Router:
    return router_for(rs, join=_ray)


def forget(deployment: str) -> None:
    """Drop every cached handle of a deployment (its workers were replaced or removed): the next
    call looks them up again; background revivals of its replicas stop."""
    with _lock:
        rs = _sets.pop(deployment, None)
    if rs is not None:
        rs.close()
    drop_router(deployment)


def _unreachable(spec: WorkerSpec, rs: ReplicaSet, rep: Replica, exc: BaseException, *, revive: bool) -> None:
    rs.forget(rep.index)
    if gone(exc):
        rs.mark_dead(rep, revive=revive)
        _router(rs).dropped(rep)


def _lookup_failed(rs: ReplicaSet, rep: Replica, exc: Unavailable) -> None:
    """Finding or starting ``rep`` failed. A replica that died or never came up leaves routing (and
    another one is tried); no Ray at all is the caller's plain ``Unavailable``."""
    cause = exc.__cause__
    if cause is not None and (gone(cause) or isinstance(cause, TimeoutError)):
        rs.mark_dead(rep, revive=True)
        raise _Retry(exc) from cause
    raise exc


def _wrap(spec: WorkerSpec, exc: BaseException) -> Unavailable:
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
        raise _wrap(spec, exc) from exc


def _pick(spec: WorkerSpec, rs: ReplicaSet, method: str, args: tuple, exclude: frozenset[int]) -> Replica:
    """The replica for one call: the router's choice for requests, the tenant's replica for KV calls,
    the first routable one otherwise. ``Unavailable`` when no replica is routable."""
    candidates = [r for r in rs.routable() if r.index not in exclude]
    if not candidates:
        raise Unavailable(f"no replica of {spec.deployment} is available; retry shortly", retry_after=5)
    req = args[0] if args and isinstance(args[0], dict) else None
    if method in CANCELLABLE or method == "stream":
        return _router(rs).choose(req, exclude=exclude) or candidates[0]
    if method in TENANT_AFFINE and req is not None and len(candidates) > 1:
        configured = rs.indices()
        start = zlib.crc32(str(req.get("tenant", "")).encode()) % len(configured)
        allowed = {r.index: r for r in candidates}
        for step in range(len(configured)):
            index = configured[(start + step) % len(configured)]
            if index in allowed:
                return allowed[index]
    return candidates[0]


def call(spec: WorkerSpec, method: str, *args, timeout: float = CALL_TIMEOUT_S, create: bool = True,
         replica: int | None = None, **kwargs):
    """Blocking call of an actor method (Celery tasks, management commands, stats). ``replica``: that
    replica (None when it does not exist and not ``create``); None: the first routable replica. Every
    failure is ``Unavailable`` (what the jobs expect); the handle is dropped only when the worker was
    unreachable, not when the method itself raised."""
    rs = replica_set(spec)
    if replica is None:
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
        _unreachable(spec, rs, rs.replica(replica), exc, revive=create)
        raise Unavailable(f"worker {spec.deployment} did not answer {method}", retry_after=5) from exc


async def _ahandle(spec: WorkerSpec, rs: ReplicaSet, rep: Replica) -> Any:
    handle = rep.handle  # fast path: no thread hop for a known actor
    return handle if handle is not None else await asyncio.to_thread(get_worker, spec, replica=rep.index)


def _prompt_tokens(args: tuple) -> int:
    req = args[0] if args and isinstance(args[0], dict) else None
    prompt = req.get("prompt") if req is not None else None
    return len(prompt) if isinstance(prompt, list) else 0


def _served_tokens(events) -> int | None:
    for ev in events if isinstance(events, list) else ():
        if isinstance(ev, dict) and ev.get("type") == "prefilled":
            return ev.get("cached_tokens")
    return None


async def acall(spec: WorkerSpec, method: str, *args, timeout: float = CALL_TIMEOUT_S, **kwargs):
    """Async call of an actor method from an ASGI view, on the replica ``_pick`` chooses. A request
    dict's ``request_id`` (first argument of ``collect``/``complete``) is cancelled on the worker if
    this coroutine is cancelled or times out. A replica found dead before answering is replaced by
    another routable one, once."""
    rs = replica_set(spec)
    tried: set[int] = set()
    while True:
        rep = _pick(spec, rs, method, args, frozenset(tried))
        tried.add(rep.index)
        try:
            return await _acall_on(spec, rs, rep, method, args, timeout, kwargs)
        except _Retry as retry:
            if len(tried) > 1 or not [r for r in rs.routable() if r.index not in tried]:
                raise retry.error from retry.__cause__
            logger.warning("retrying %s of %s on another replica", method, spec.deployment)


class _Retry(Exception):
    """Internal: the replica died before answering; ``error`` is what the caller gets if no other can."""

    def __init__(self, error: Unavailable) -> None:
        super().__init__(error.message)
        self.error = error


async def _acall_on(spec: WorkerSpec, rs: ReplicaSet, rep: Replica, method: str, args: tuple, timeout: float,
                    kwargs: dict):
    cancellable = method in CANCELLABLE
    rid = request_id_of(args) if cancellable else None
    ref = None
    try:
        handle = await _ahandle(spec, rs, rep)
    except Unavailable as exc:
        _lookup_failed(rs, rep, exc)
    prompt = _prompt_tokens(args) if cancellable else 0
    with rs.using(rep, rid, prompt):
        try:
            ref = getattr(handle, method).remote(*args, **kwargs)
            result = await asyncio.wait_for(ref, timeout)
        except asyncio.CancelledError:
            if cancellable:
                _cancel_remote(spec, handle, rid, ref)
            raise
        except Exception as exc:
            refused = worker_error(spec, exc)
            if refused is not None:
                raise refused from None
            if cancellable and isinstance(exc, TimeoutError):  # the result will not be read: stop the work
                _cancel_remote(spec, handle, rid, ref)
            _unreachable(spec, rs, rep, exc, revive=True)
            error = Unavailable(f"worker {spec.deployment} did not answer", retry_after=5)
            if gone(exc):
                raise _Retry(error) from exc
            raise error from exc
    if cancellable:
        _router(rs).served(rep, args[0] if args else None, _served_tokens(result))
    return result


async def astream(spec: WorkerSpec, req: dict) -> AsyncIterator[dict]:
    """Stream a request's events from a replica the router chose. Raises ``Unavailable`` if no
    replica can be reached before the first event (a dead one is replaced by another, once), or the
    API error for a request the worker refused; later failures surface as a retryable ``error``
    event. Closing the generator early, or cancelling the task iterating it, cancels the request on
    the worker."""
    rs = replica_set(spec)
    tried: set[int] = set()
    while True:
        rep = _pick(spec, rs, "stream", (req,), frozenset(tried))
        tried.add(rep.index)
        try:
            async for event in _stream_on(spec, rs, rep, req):
                yield event
            return
        except _Retry as retry:
            if len(tried) > 1 or not [r for r in rs.routable() if r.index not in tried]:
                raise retry.error from retry.__cause__
            logger.warning("retrying a stream of %s on another replica", spec.deployment)


async def _stream_on(spec: WorkerSpec, rs: ReplicaSet, rep: Replica, req: dict) -> AsyncIterator[dict]:
    try:
        handle = await _ahandle(spec, rs, rep)
    except Unavailable as exc:
        _lookup_failed(rs, rep, exc)
    rid = request_id_of((req,))
    prompt = _prompt_tokens((req,))
    started = ended = False
    gen = None
    with rs.using(rep, rid, prompt):
        try:
            gen = handle.stream.remote(req)
            async for ref in gen:
                event = await ref
                started = True
                kind = event.get("type")
                ended = kind in ("finished", "error")  # the worker is done with it
                if kind == "prefilled":
                    rs.prefilled(rep, prompt)
                    _router(rs).served(rep, req, event.get("cached_tokens"))
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            if not ended:
                _cancel_remote(spec, handle, rid, gen)
            raise
        except Exception as exc:
            refused = worker_error(spec, exc)
            if refused is None:
                _unreachable(spec, rs, rep, exc, revive=True)
            if not started:
                if refused is not None:
                    raise refused from None
                error = Unavailable(f"worker {spec.deployment} is unavailable; retry shortly", retry_after=5)
                if gone(exc):
                    raise _Retry(error) from exc
                raise error from exc
            logger.warning("stream from %s broke: %s", rep.name, type(exc).__name__)
            if refused is not None:
                yield {"type": "error", "code": refused.code, "message": refused.message,
                       "retryable": refused.status >= 500}
            else:
                yield {"type": "error", "code": "worker_failed", "message": "the cache worker failed mid-stream",
                       "retryable": True}


def apply_scale(spec: WorkerSpec, *, wait: bool = False) -> dict | None:
    """Bring ``spec``'s deployment to ``spec.replicas`` running replicas: missing ones are started,
    replicas beyond the count drained (out of routing now; killed once their running requests ended,
    at the latest after ``STRATA_DRAIN_SECONDS``). In a background thread unless ``wait`` (then the
    ``ReplicaSet.scale`` result). Without a reachable Ray it logs and does nothing: the replicas
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


def workers_ready() -> dict:
    """Readiness: can this process reach Ray? (Actors are created on demand per deployment.)"""
    try:
        import ray as _r

        if not _r.is_initialized() and not getattr(settings, "STRATA_RAY_ADDRESS", None):
            return {"ok": False, "error": "not connected to Ray (RAY_ADDRESS unset)"}
        ray = _ray()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return {"ok": bool(nodes), "nodes": len(nodes)}
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__}

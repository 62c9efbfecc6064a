"""Gateway from Django processes (web, Celery) to the cache-worker Ray actors.

Ray is joined lazily on first use, and only joined, never started: ``STRATA_RAY_ADDRESS``
(``RAY_ADDRESS``; the launcher sets it for its children), or a Ray this process already initialised
(tests). With neither, every call is ``Unavailable``: a web or Celery process must not quietly start
a Ray cluster of its own. Actor handles are cached per deployment. Every blocking Ray call runs in a
thread so the ASGI event loop never stalls; object refs are awaited natively.

Errors: a worker that cannot be reached (actor dead or unavailable, timeout, connection lost) is
``Unavailable`` (503 with Retry-After) and its cached handle is dropped. An error the actor method
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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from cachecore.errors import CacheError
from controlplane.common.errors import ApplicationError, Unavailable, WorkerError

logger = logging.getLogger("controlplane.runtime")

CALL_TIMEOUT_S = 30.0
GENERATION_TIMEOUT_S = 600.0  # a whole non-streamed generation (long outputs on a CPU)
CREATE_TIMEOUT_S = 120.0
CANCELLABLE = frozenset({"collect", "complete"})  # methods whose first argument is a request dict
_BAD_INPUT = (ValueError, TypeError, ArithmeticError, LookupError)  # bad values the worker refused
_lock = threading.Lock()
_handles: dict[str, Any] = {}


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
    """Fire-and-forget cancel of ``request_id`` on its worker, from any thread (a response closer).
    A request that already ended is not affected. Never raises, never waits."""
    handle = _handles.get(spec.deployment)
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


def _handle(spec: WorkerSpec, create: bool) -> Any:
    from workers import actor

    with _lock:
        handle = _handles.get(spec.deployment)
        if handle is not None:
            return handle
        _ray()
        handle = actor.find(spec.deployment)
        if handle is None:
            if not create:
                return None
            handle = actor.launch(spec.deployment, spec.preset, spec.revision)
            _ray().get(handle.ping.remote(), timeout=CREATE_TIMEOUT_S)  # weights loaded, ready
        _handles[spec.deployment] = handle
        return handle


def forget(deployment: str) -> None:
    """Drop a cached handle (after an actor died) so the next call looks it up again."""
    with _lock:
        _handles.pop(deployment, None)


def get_worker(spec: WorkerSpec, *, create: bool = True) -> Any:
    """Blocking: the actor handle for ``spec`` (created if absent and ``create``)."""
    try:
        return _handle(spec, create)
    except Unavailable:
        raise
    except Exception as exc:
        forget(spec.deployment)
        logger.warning("worker for %s unavailable: %r", spec.deployment, exc, exc_info=True)
        raise Unavailable("cache workers are unavailable; retry shortly", retry_after=5) from exc


def call(spec: WorkerSpec, method: str, *args, timeout: float = CALL_TIMEOUT_S, create: bool = True, **kwargs):
    """Blocking call of an actor method (Celery tasks, management commands). Every failure is
    ``Unavailable`` (what the jobs expect); the handle is dropped only when the worker was unreachable,
    not when the method itself raised."""
    handle = get_worker(spec, create=create)
    if handle is None:
        return None
    try:
        return _ray().get(getattr(handle, method).remote(*args, **kwargs), timeout=timeout)
    except Exception as exc:
        refused = worker_error(spec, exc)
        if refused is not None:
            raise Unavailable(f"worker {spec.deployment} failed {method}: {refused.message}", retry_after=5) from exc
        forget(spec.deployment)
        raise Unavailable(f"worker {spec.deployment} did not answer {method}", retry_after=5) from exc


async def _ahandle(spec: WorkerSpec) -> Any:
    handle = _handles.get(spec.deployment)  # fast path: no thread hop for a known actor
    return handle if handle is not None else await asyncio.to_thread(get_worker, spec)


async def acall(spec: WorkerSpec, method: str, *args, timeout: float = CALL_TIMEOUT_S, **kwargs):
    """Async call of an actor method from an ASGI view. A request dict's ``request_id`` (first
    argument of ``collect``/``complete``) is cancelled on the worker if this coroutine is cancelled or
    times out."""
    handle = await _ahandle(spec)
    cancellable = method in CANCELLABLE
    rid = request_id_of(args) if cancellable else None
    ref = None
    try:
        ref = getattr(handle, method).remote(*args, **kwargs)
        return await asyncio.wait_for(ref, timeout)
    except asyncio.CancelledError:
        if cancellable:
            _cancel_remote(spec, handle, rid, ref)
        raise
    except Unavailable:
        raise
    except Exception as exc:
        refused = worker_error(spec, exc)
        if refused is not None:
            raise refused from None
        if cancellable and isinstance(exc, TimeoutError):  # the result will not be read: stop the work
            _cancel_remote(spec, handle, rid, ref)
        forget(spec.deployment)
        raise Unavailable(f"worker {spec.deployment} did not answer", retry_after=5) from exc


async def astream(spec: WorkerSpec, req: dict) -> AsyncIterator[dict]:
    """Stream a request's events from its worker. Raises ``Unavailable`` if the worker cannot be
    reached before the first event (or the API error for a request the worker refused); later
    failures surface as an ``error`` event. Closing the generator early, or cancelling the task
    iterating it, cancels the request on the worker."""
    handle = await _ahandle(spec)
    rid = request_id_of((req,))
    started = ended = False
    gen = None
    try:
        gen = handle.stream.remote(req)
        async for ref in gen:
            event = await ref
            started = True
            ended = event.get("type") in ("finished", "error")  # the worker is done with it
            yield event
    except (asyncio.CancelledError, GeneratorExit):
        if not ended:
            _cancel_remote(spec, handle, rid, gen)
        raise
    except Exception as exc:
        refused = worker_error(spec, exc)
        if refused is None:
            forget(spec.deployment)
        if not started:
            if refused is not None:
                raise refused from None
            raise Unavailable(f"worker {spec.deployment} is unavailable; retry shortly", retry_after=5) from exc
        logger.warning("stream from %s broke: %s", spec.deployment, type(exc).__name__)
        if refused is not None:
            yield {"type": "error", "code": refused.code, "message": refused.message,
                   "retryable": refused.status >= 500}
        else:
            yield {"type": "error", "code": "worker_failed", "message": "the cache worker failed mid-stream",
                   "retryable": True}


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

"""Gateway from Django processes (web, Celery) to the cache-worker Ray actors.

Ray is joined lazily on first use: ``RAY_ADDRESS`` when set (the launcher sets it for its children),
otherwise an already-initialised local Ray (tests) or ``ray.init()`` of a local one. Actor handles
are cached per deployment. Every blocking Ray call runs in a thread so the ASGI event loop never
stalls; object refs are awaited natively. Any failure to reach a worker becomes ``Unavailable``
(503 with Retry-After), never a hang or a 500.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from controlplane.common.errors import Unavailable

logger = logging.getLogger("controlplane.runtime")

CALL_TIMEOUT_S = 30.0
GENERATION_TIMEOUT_S = 600.0  # a whole non-streamed generation (long outputs on a CPU)
CREATE_TIMEOUT_S = 120.0
_lock = threading.Lock()
_handles: dict[str, Any] = {}


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker for one deployment is started with (from the registry's active revision)."""

    deployment: str
    preset: str
    revision: dict  # {"label", "seed"} or {"label", "weights_path"}


def spec_for(deployment) -> WorkerSpec:
    """The worker spec of a registry ``ModelDeployment`` at its active revision."""
    rev = deployment.active_revision
    source = {"weights_path": rev.weights_path} if rev.weights_path else {"seed": rev.seed}
    return WorkerSpec(deployment=deployment.name, preset=deployment.preset, revision={"label": rev.label, **source})


def _ray():
    import ray

    if not ray.is_initialized():
        address = getattr(settings, "STRATA_RAY_ADDRESS", None)
        kwargs = {"namespace": "strata", "ignore_reinit_error": True, "log_to_driver": False}
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(include_dashboard=False, **kwargs)
    return ray


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
    except Exception as exc:
        forget(spec.deployment)
        logger.warning("worker for %s unavailable: %r", spec.deployment, exc, exc_info=True)
        raise Unavailable("cache workers are unavailable; retry shortly", retry_after=5) from exc


def call(spec: WorkerSpec, method: str, *args, timeout: float = CALL_TIMEOUT_S, create: bool = True, **kwargs):
    """Blocking call of an actor method (Celery tasks, management commands)."""
    handle = get_worker(spec, create=create)
    if handle is None:
        return None
    try:
        return _ray().get(getattr(handle, method).remote(*args, **kwargs), timeout=timeout)
    except Exception as exc:
        forget(spec.deployment)
        raise Unavailable(f"worker {spec.deployment} did not answer {method}", retry_after=5) from exc


async def _ahandle(spec: WorkerSpec) -> Any:
    handle = _handles.get(spec.deployment)  # fast path: no thread hop for a known actor
    return handle if handle is not None else await asyncio.to_thread(get_worker, spec)


async def acall(spec: WorkerSpec, method: str, *args, timeout: float = CALL_TIMEOUT_S, **kwargs):
    """Async call of an actor method from an ASGI view."""
    handle = await _ahandle(spec)
    try:
        ref = getattr(handle, method).remote(*args, **kwargs)
        return await asyncio.wait_for(ref, timeout)
    except Unavailable:
        raise
    except Exception as exc:
        forget(spec.deployment)
        raise Unavailable(f"worker {spec.deployment} did not answer", retry_after=5) from exc


async def astream(spec: WorkerSpec, req: dict) -> AsyncIterator[dict]:
    """Stream a request's events from its worker. Raises ``Unavailable`` if the worker cannot be
    reached before the first event; later failures surface as an ``error`` event."""
    handle = await _ahandle(spec)
    started = False
    try:
        gen = handle.stream.remote(req)
        async for ref in gen:
            event = await ref
            started = True
            yield event
    except Exception as exc:
        forget(spec.deployment)
        if not started:
            raise Unavailable(f"worker {spec.deployment} is unavailable; retry shortly", retry_after=5) from exc
        logger.warning("stream from %s broke: %s", spec.deployment, type(exc).__name__)
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

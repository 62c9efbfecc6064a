"""Serving calls to a deployment's replicas: which replica (``_pick``: the router for requests, the
tenant's replica for KV calls, the first routable one otherwise), and failover.

A replica that cannot be reached leaves routing at once and is re-launched in the background and put
back when it answers. A request that failed that way before anything was streamed is retried once on
another routable replica; a stream that broke later ends with a retryable ``error`` event.
Cancellation: when the awaiting coroutine is cancelled (Django cancels the view when the client
disconnects) or a stream is closed early, the request is cancelled on its worker
(``cancel(request_id)``, fire-and-forget) so it stops at its next step and releases its blocks.

Starting replicas: a request never launches and waits for an engine without bound. A replica whose
handle this process does not know yet is started in the background (``ReplicaSet.start_async``:
found at once when it already runs) and waited for at most ``STRATA_START_WAIT_SECONDS`` (default
``START_WAIT_S``); past that the request is 503 ``model_starting`` with ``Retry-After`` while the
start goes on. A replica whose start failed is 503 ``replica_failed`` with its error (another replica
is tried first), and is not started again from a request for ``replicas.FAILED_HOLD_S``. A stopped
deployment (``replicas = 0``) is 503 ``model_stopped`` before anything is chosen or started, and a
revision whose weights are still being hashed 503 ``model_starting`` (``model_failed`` when hashing
them failed: ``WorkerSpec.unservable``), with nothing started.

A call's first try can be started from another thread (``submit``: the router's pick, the replica's
in-flight count and the actor call), so that the worker is already at work while the event loop takes
the answer up (``acall(..., started=...)``); a started call nobody will await is ``abandon``-ed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from controlplane.common.errors import Unavailable
from controlplane.runtime.cluster import (
    CALL_TIMEOUT_S,
    WorkerSpec,
    cancel_remote,
    replica_set,
    request_id_of,
    router_of,
    worker_error,
)
from controlplane.runtime.replicas import FAILED_HOLD_S, Replica, ReplicaSet, gone

logger = logging.getLogger("controlplane.runtime")

CANCELLABLE = frozenset({"collect"})  # methods whose first argument is a request dict
# a tenant's KV calls meet on one replica
TENANT_AFFINE = frozenset({"kv_lookup", "kv_store", "kv_retrieve", "kv_store_wire", "kv_retrieve_wire"})
START_WAIT_S = 30.0  # how long a request waits for a starting replica (STRATA_START_WAIT_SECONDS)
STARTING_RETRY_AFTER_S = 10
STOPPED_RETRY_AFTER_S = 60


def start_wait_s() -> float:
    """``STRATA_START_WAIT_SECONDS``: the bound on a request's wait for a starting replica."""
    return max(0.0, float(getattr(settings, "STRATA_START_WAIT_SECONDS", START_WAIT_S)))


def stopped(spec: WorkerSpec) -> Unavailable:
    """The 503 of a stopped deployment (``replicas = 0``): nothing is started for it."""
    return Unavailable(f"model {spec.deployment} is stopped; an operator must start it again",
                       code="model_stopped", retry_after=STOPPED_RETRY_AFTER_S)


def held(spec: WorkerSpec) -> Unavailable | None:
    """The 503 of a revision that may not serve yet (``spec.unservable``), or None."""
    if spec.unservable is None:
        return None
    code, message = spec.unservable
    return Unavailable(message, code=code,
                       retry_after=STARTING_RETRY_AFTER_S if code == "model_starting" else STOPPED_RETRY_AFTER_S)


def _pick(spec: WorkerSpec, rs: ReplicaSet, method: str, args: tuple, exclude: frozenset[int]) -> Replica:
    """The replica for one call: the router's choice for requests, the tenant's replica for KV calls,
    the first routable one otherwise. ``Unavailable`` when no replica is routable."""
    if rs.count == 0:
        raise stopped(spec)
    if (error := held(spec)) is not None:
        raise error
    candidates = [r for r in rs.routable() if r.index not in exclude]
    if not candidates:
        raise Unavailable(f"no replica of {spec.deployment} is available; retry shortly", retry_after=5)
    req = args[0] if args and isinstance(args[0], dict) else None
    if method in CANCELLABLE or method == "stream":
        return router_of(rs).choose(req, exclude=exclude) or candidates[0]
    if method in TENANT_AFFINE and req is not None and len(candidates) > 1:
        configured = rs.indices()
        start = zlib.crc32(str(req.get("tenant", "")).encode()) % len(configured)
        allowed = {r.index: r for r in candidates}
        for step in range(len(configured)):
            index = configured[(start + step) % len(configured)]
            if index in allowed:
                return allowed[index]
    return candidates[0]


def unreachable(spec: WorkerSpec, rs: ReplicaSet, rep: Replica, exc: BaseException, *, revive: bool) -> None:
    """A call to ``rep`` failed without an answer: its handle is dropped (looked up again next time);
    if it is gone (``replicas.gone``) it also leaves routing and the router's index, and with
    ``revive`` is re-launched in the background."""
    rs.forget(rep.index)
    if gone(exc):
        rs.mark_dead(rep, revive=revive)
        router_of(rs).dropped(rep)


async def _ahandle(spec: WorkerSpec, rs: ReplicaSet, rep: Replica) -> Any:
    """``rep``'s handle: the known one (no thread hop), else its background start awaited for at most
    ``start_wait_s()`` (see the module docstring)."""
    handle = rep.handle
    if handle is not None:
        return handle
    held = rs.held_failure(rep)
    if held is not None:
        raise _Retry(_failed(spec, rep, held))
    start = rs.start_async(rep.index)
    try:
        # shield: the start goes on for the next request when this one stops waiting
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(start)), start_wait_s())
    except Exception as exc:
        if not start.done():  # the bound passed (a start's own timeout is a failure, below)
            raise Unavailable(f"model {spec.deployment} is starting (replica {rep.index}); retry shortly",
                              code="model_starting", retry_after=STARTING_RETRY_AFTER_S) from None
        if isinstance(exc, Unavailable):
            raise  # no Ray cluster at all
        raise _Retry(_failed(spec, rep, rep.start_error or type(exc).__name__)) from None


def _failed(spec: WorkerSpec, rep: Replica, error: str) -> Unavailable:
    return Unavailable(f"replica {rep.index} of model {spec.deployment} failed to start: {error}",
                       code="replica_failed", retry_after=int(FAILED_HOLD_S))


def _prompt_tokens(args: tuple) -> int:
    req = args[0] if args and isinstance(args[0], dict) else None
    prompt = req.get("prompt") if req is not None else None
    return len(prompt) if isinstance(prompt, list) else 0


def _served_tokens(events) -> int | None:
    for ev in events if isinstance(events, list) else ():
        if isinstance(ev, dict) and ev.get("type") == "prefilled":
            return ev.get("cached_tokens")
    return None


@dataclass
class Started:
    """An actor call submitted to ``rep`` (``ref``, or the ``error`` its submission raised), holding the
    replica's in-flight count until ``release`` is closed (by the await, or ``abandon``). With no
    ``handle``, only the replica was chosen (its handle was not known yet): the await looks the
    handle up and makes the call there."""

    spec: WorkerSpec
    rep: Replica
    handle: Any
    method: str
    request_id: str | None
    ref: Any = None
    error: Exception | None = None
    release: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


def _begin(spec: WorkerSpec, rs: ReplicaSet, rep: Replica, handle: Any, method: str, args: tuple,
           kwargs: dict) -> Started:
    cancellable = method in CANCELLABLE
    started = Started(spec, rep, handle, method, request_id_of(args) if cancellable else None)
    started.release.enter_context(rs.using(rep, started.request_id, _prompt_tokens(args) if cancellable else 0))
    try:
        started.ref = getattr(handle, method).remote(*args, **kwargs)
    except Exception as exc:  # raised where the answer is awaited, as an await's failure would be
        started.error = exc
    return started


def submit(spec: WorkerSpec, method: str, *args, **kwargs) -> Started | None:
    """``acall``'s first try, started in the calling thread (any thread): the replica ``_pick`` chooses
    (the router's choice is made once per call), its in-flight count and the actor call; only the
    choice when that replica's handle is not known yet. None, with nothing chosen, when no replica is
    routable: ``acall`` then answers the error."""
    rs = replica_set(spec)
    rs.revive_dead()
    try:
        rep = _pick(spec, rs, method, args, frozenset())
    except Unavailable:
        return None
    handle = rep.handle
    if handle is None:
        return Started(spec, rep, None, method, request_id_of(args) if method in CANCELLABLE else None)
    return _begin(spec, rs, rep, handle, method, args, kwargs)


def abandon(started: Started) -> None:
    """A started call whose answer nobody will await (the request was cancelled meanwhile): cancelled on
    its worker, its in-flight count released. Never raises."""
    if started.method in CANCELLABLE and started.handle is not None:
        cancel_remote(started.spec, started.handle, started.request_id, started.ref)
    started.release.close()


async def acall(spec: WorkerSpec, method: str, *args, timeout: float = CALL_TIMEOUT_S,
                started: Started | None = None, **kwargs):
    """Async call of an actor method from an ASGI view, on the replica ``_pick`` chooses (or the one
    ``started`` was submitted to by ``submit``, with these ``args``). A request dict's ``request_id``
    (first argument of ``collect``/``complete``) is cancelled on the worker if this coroutine is
    cancelled or times out. A replica found dead before answering is replaced by another routable one,
    once."""
    rs = replica_set(spec)
    if started is None:
        rs.revive_dead()  # else done by submit
    tried: set[int] = set()
    while True:
        rep = started.rep if started is not None else _pick(spec, rs, method, args, frozenset(tried))
        tried.add(rep.index)
        try:
            return await _acall_on(spec, rs, rep, method, args, timeout, kwargs, started)
        except _Retry as retry:
            if len(tried) > 1 or not [r for r in rs.routable() if r.index not in tried]:
                raise retry.error from retry.__cause__
            logger.warning("retrying %s of %s on another replica", method, spec.deployment)
        finally:
            started = None  # a retry is a call of its own


class _Retry(Exception):
    """Internal: the replica died before answering; ``error`` is what the caller gets if no other can."""

    def __init__(self, error: Unavailable) -> None:
        super().__init__(error.message)
        self.error = error


async def _acall_on(spec: WorkerSpec, rs: ReplicaSet, rep: Replica, method: str, args: tuple, timeout: float,
                    kwargs: dict, started: Started | None = None):
    cancellable = method in CANCELLABLE
    if started is None or started.handle is None:  # not submitted yet (at most chosen)
        handle = await _ahandle(spec, rs, rep)
        started = _begin(spec, rs, rep, handle, method, args, kwargs)
    handle, rid = started.handle, started.request_id
    with started.release:
        try:
            if started.error is not None:
                raise started.error
            result = await asyncio.wait_for(started.ref, timeout)
        except asyncio.CancelledError:
            if cancellable:
                cancel_remote(spec, handle, rid, started.ref)
            raise
        except Exception as exc:
            refused = worker_error(spec, exc)
            if refused is not None:
                raise refused from None
            if cancellable and isinstance(exc, TimeoutError):  # the result will not be read: stop the work
                cancel_remote(spec, handle, rid, started.ref)
            unreachable(spec, rs, rep, exc, revive=True)
            error = Unavailable(f"worker {spec.deployment} did not answer", retry_after=5)
            if gone(exc):
                raise _Retry(error) from exc
            raise error from exc
    if cancellable:
        router_of(rs).served(rep, args[0] if args else None, _served_tokens(result))
    return result


async def astream(spec: WorkerSpec, req: dict) -> AsyncIterator[dict]:
    """Stream a request's events from a replica the router chose. Raises ``Unavailable`` if no
    replica can be reached before the first event (a dead one is replaced by another, once), or the
    API error for a request the worker refused; later failures surface as a retryable ``error``
    event. Closing the generator early, or cancelling the task iterating it, cancels the request on
    the worker."""
    rs = replica_set(spec)
    rs.revive_dead()
    tried: set[int] = set()
    while True:
        rep = _pick(spec, rs, "stream", (req,), frozenset(tried))
        tried.add(rep.index)
        try:
            # aclosing: when this generator is closed, the replica's stream is closed at once (its
            # in-flight count released), not whenever the abandoned inner generator is collected.
            async with contextlib.aclosing(_stream_on(spec, rs, rep, req)) as events:
                async for event in events:
                    yield event
            return
        except _Retry as retry:
            if len(tried) > 1 or not [r for r in rs.routable() if r.index not in tried]:
                raise retry.error from retry.__cause__
            logger.warning("retrying a stream of %s on another replica", spec.deployment)


async def _stream_on(spec: WorkerSpec, rs: ReplicaSet, rep: Replica, req: dict) -> AsyncIterator[dict]:
    handle = await _ahandle(spec, rs, rep)
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
                    router_of(rs).served(rep, req, event.get("cached_tokens"))
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            if not ended:
                cancel_remote(spec, handle, rid, gen)
            raise
        except Exception as exc:
            refused = worker_error(spec, exc)
            if refused is None:
                unreachable(spec, rs, rep, exc, revive=True)
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

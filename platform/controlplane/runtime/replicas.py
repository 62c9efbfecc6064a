"""ReplicaSet: the one directory of a deployment's replicas, used by the gateway (routing, failover),
the jobs (every replica reached and verified), the stats and ``/metrics``.

A deployment with ``replicas = n`` has the named Ray actors ``cache-worker:<deployment>:<i>`` for
``i`` in ``0..n-1`` (``workers.actor.actor_name``). The count comes from the registry on every call
(``WorkerSpec.replicas``), so a scale-down stops routing to the dropped replicas in every process at
once; this directory only keeps what one process learned about each replica:

- ``handle``: the cached actor handle (looked up by name, created on demand when the caller may);
- ``dead``: the replica failed a call as unreachable. It leaves routing at once; with ``revive`` (the
  serving path) a background thread re-launches it (``actor.launch`` with the current spec: name
  lookup first, so a replica Ray already restarted is simply found again) and puts it back once it
  answers ``ping``; jobs address every replica by index regardless;
- ``draining``: being scaled away: no new requests; killed once its running requests ended (or at the
  drain deadline);
- ``inflight`` / ``pending_tokens``: requests this process has on the replica and their prompt
  tokens not yet prefilled (the router's local view of queued work between polls);
- ``start``: this process's background start of the replica (``start_async``: launched if absent,
  waited for, then its handle installed), and the error of its last failed start.

A deployment with ``replicas = 0`` is stopped: no index is configured, nothing is routable or started.
Every start and stop is reported to the replica board (``workers.replica_board``), which every
process reads for the replicas' states.

Blocking methods (``handle``, ``start_all``, ``drain``, ``scale``) talk to Ray and must not run on an
event loop. Errors from Ray propagate to the caller (the gateway turns them into ``Unavailable``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from workers import replica_board

logger = logging.getLogger("controlplane.runtime")

MAX_REPLICAS = 16  # the admin API's bound; also how far ``scale`` looks for orphaned replicas
REVIVE_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
DRAIN_POLL_S = 0.2
FAILED_HOLD_S = 30.0  # a replica whose start failed is not started again from a request before this
SHUTDOWN_TIMEOUT_S = 30.0  # a drained replica's engine stops (its processes exit) within this


def gone(exc: BaseException) -> bool:
    """Whether a call's exception means the replica itself is gone (its actor died or is being
    restarted, or the connection to it was lost), not merely slow or refusing the request."""
    from ray.exceptions import RayActorError

    return isinstance(exc, (RayActorError, ConnectionError))


@dataclass
class Replica:
    """What this process knows of one replica (index ``index`` of its deployment)."""

    index: int
    name: str
    handle: Any = None
    dead: bool = False
    draining: bool = False
    reviving: bool = False
    inflight: int = 0
    pending_tokens: int = 0
    failures: int = 0  # times this process saw it unreachable
    revivals: int = 0  # times this process put it back after a failure
    node_id: str | None = None
    requests: set[str] = field(default_factory=set)  # request ids in flight here (for cancel)
    start: Future | None = None  # this process's background start (``ReplicaSet.start_async``)
    start_error: str | None = None  # why the last start from this process failed
    failed_at: float | None = None  # when (monotonic)


class ReplicaSet:
    """The replicas of one deployment. Thread-safe; cheap non-blocking reads for the event loop.

    ``join`` returns the ``ray`` module joined to the cluster (the gateway's ``_ray``); ``actor_api``
    is ``workers.actor`` (``actor_name``, ``find``, ``launch``), injectable for tests; ``refresh``
    returns the registry's current spec (or None): a revival launches with it, so a replica that
    died after a rollout comes back on the new revision even if no request brought the new spec.
    """

    def __init__(self, deployment: str, *, join: Callable[[], Any], actor_api: Any = None,
                 create_timeout: float = 120.0, refresh: Callable[[], Any] | None = None) -> None:
        if actor_api is None:
            from workers import actor as actor_api
        self.deployment = deployment
        self.spec: Any = None  # the latest WorkerSpec seen (count, preset, revision)
        self._join, self._actor, self._create_timeout = join, actor_api, create_timeout
        self._refresh = refresh
        self._lock = threading.RLock()
        self._replicas: dict[int, Replica] = {}
        self._start_lock = threading.Lock()
        self.closed = False  # forgotten by the gateway: background revivals stop

    # ------------------------------------------------------------------ directory (non-blocking)
    def update(self, spec) -> ReplicaSet:
        """Remember ``spec`` (the registry's latest view of the deployment). Returns self."""
        self.spec = spec
        return self

    @property
    def count(self) -> int:
        """Configured replicas; 0: the deployment is stopped."""
        replicas = getattr(self.spec, "replicas", 1)
        return 1 if replicas is None else max(0, int(replicas))

    def replica(self, index: int) -> Replica:
        with self._lock:
            rep = self._replicas.get(index)
            if rep is None:
                rep = self._replicas[index] = Replica(index, self._actor.actor_name(self.deployment, index))
            return rep

    def indices(self) -> list[int]:
        """Every configured replica index (what the jobs and the stats address)."""
        return list(range(self.count))

    def routable(self) -> list[Replica]:
        """Configured replicas that may take new requests: not dead, not draining."""
        return [rep for i in self.indices() if not (rep := self.replica(i)).dead and not rep.draining]

    def cached(self, index: int) -> Any:
        rep = self._replicas.get(index)
        return rep.handle if rep is not None else None

    def install(self, index: int, handle: Any) -> None:
        """Use ``handle`` for replica ``index`` (a handle found elsewhere; tests' stand-ins)."""
        rep = self.replica(index)
        with self._lock:
            rep.handle, rep.dead = handle, False

    def forget(self, index: int | None = None) -> None:
        """Drop cached handles (one replica, or all) so the next call looks them up again."""
        with self._lock:
            for i, rep in self._replicas.items():
                if index is None or i == index:
                    rep.handle = None

    def close(self) -> None:
        """Stop background revivals and drop every handle (the gateway forgot this deployment)."""
        self.closed = True
        self.forget()

    def where(self, request_id: str) -> Replica | None:
        """The replica a request id is in flight on (this process's dispatches only)."""
        with self._lock:
            return next((r for r in self._replicas.values() if request_id in r.requests), None)

    @contextmanager
    def using(self, rep: Replica, request_id: str | None = None, prompt_tokens: int = 0) -> Iterator[None]:
        """Account one request on ``rep`` for the duration of the block."""
        with self._lock:
            rep.inflight += 1
            rep.pending_tokens += prompt_tokens
            if request_id:
                rep.requests.add(request_id)
        try:
            yield
        finally:
            with self._lock:
                rep.inflight -= 1
                rep.pending_tokens = max(0, rep.pending_tokens - prompt_tokens)
                if request_id:
                    rep.requests.discard(request_id)

    def prefilled(self, rep: Replica, prompt_tokens: int) -> None:
        """A request's prompt was prefilled: it no longer counts as queued prefill work."""
        with self._lock:
            rep.pending_tokens = max(0, rep.pending_tokens - prompt_tokens)

    def mark_dead(self, rep: Replica, *, revive: bool) -> None:
        """``rep`` did not answer: out of routing now, handle dropped; with ``revive`` a background
        thread re-launches it and puts it back when it answers."""
        with self._lock:
            rep.handle, rep.dead = None, True
            rep.failures += 1
            start = revive and not rep.reviving and not self.closed and self.spec is not None
            if start:
                rep.reviving = True
        logger.warning("replica %s is unreachable; out of routing%s", rep.name, " (reviving)" if start else "")
        if start:
            threading.Thread(target=self._revive, args=(rep,), name=f"revive-{rep.name}", daemon=True).start()

    def revive_dead(self) -> None:
        """Start reviving every configured replica that is dead with no revival running: one that a
        caller which may not launch replicas (stats, the console, jobs: ``mark_dead(revive=False)``)
        took out of routing, where nothing else would bring it back. The serving paths call this:
        they are the callers that launch replicas."""
        with self._lock:
            if self.closed or self.spec is None:
                return
            todo = [rep for i, rep in self._replicas.items()
                    if i < self.count and rep.dead and not rep.reviving and not rep.draining]
            for rep in todo:
                rep.reviving = True
        for rep in todo:
            logger.warning("replica %s is dead with no revival running; reviving it", rep.name)
            threading.Thread(target=self._revive, args=(rep,), name=f"revive-{rep.name}", daemon=True).start()

    def describe(self, index: int) -> dict:
        """Plain data for stats: replica ``index``'s routing state as this process sees it (``ready``,
        ``dead``, ``draining`` or ``unknown``: not called yet), its requests in flight from here,
        and how often this process saw it fail and put it back."""
        rep = self.replica(index)
        state = "draining" if rep.draining else "dead" if rep.dead else "ready" if rep.handle else "unknown"
        return {"state": state, "inflight": rep.inflight, "failures": rep.failures, "revivals": rep.revivals}

    # ------------------------------------------------------------------ Ray (blocking)
    def handle(self, index: int, *, create: bool) -> Any:
        """The handle of replica ``index``: cached, found by name, or (``create``) launched and waited
        for (weights loaded). None when it does not exist and ``create`` is False."""
        rep = self.replica(index)
        if rep.handle is not None:
            return rep.handle
        self._join()
        handle = self._actor.find(self.deployment, index)
        if handle is None:
            if not create:
                return None
            return self._start_one(index)
        with self._lock:
            rep.handle, rep.dead = handle, False
        return handle

    def _servable(self) -> None:
        """No replica starts for a revision that may not serve yet (``WorkerSpec.unservable``: its
        weights are being hashed): ``Unavailable``, which is no fault of the replica's."""
        hold = getattr(self.spec, "unservable", None)
        if hold:
            from controlplane.common.errors import Unavailable

            raise Unavailable(hold[1], code=hold[0], retry_after=10)

    def _start_one(self, index: int) -> Any:
        """Blocking: find or launch replica ``index``, wait until it answers (its engine built), use its
        handle; each step reported to the replica board. Raises what Ray raised (reported ``failed``)."""
        self._servable()
        rep = self.replica(index)
        ray = self._join()
        handle = self._actor.find(self.deployment, index)
        if handle is None:
            replica_board.report(rep.name, "starting", phase="waiting for the actor (resources)")
            handle = self._launch(index)
        try:
            ray.get(handle.ping.remote(), timeout=self._create_timeout)
        except Exception as exc:
            replica_board.report(rep.name, "failed", error=_reason(exc))
            raise
        replica_board.report(rep.name, "ready")
        with self._lock:
            rep.handle, rep.dead = handle, False
            rep.start_error = rep.failed_at = None
        return handle

    def start_async(self, index: int) -> Future:
        """Start replica ``index`` in a background thread (``_start_one``), once per process at a time:
        a start already running is returned. The future's result is the handle; its exception what
        the start raised (also kept as ``start_error``). Never blocks."""
        with self._lock:
            rep = self.replica(index)
            if rep.start is not None and not rep.start.done():
                return rep.start
            future = rep.start = Future()
        threading.Thread(target=self._run_start, args=(rep, future), name=f"start-{rep.name}", daemon=True).start()
        return future

    def _run_start(self, rep: Replica, future: Future) -> None:
        try:
            future.set_result(self._start_one(rep.index))
        except BaseException as exc:
            if not _no_cluster(exc):  # no Ray at all is no fault of the replica's
                with self._lock:
                    rep.start_error, rep.failed_at = _reason(exc), time.monotonic()
            logger.warning("replica %s did not start: %r", rep.name, exc)
            future.set_exception(exc)

    def held_failure(self, rep: Replica) -> str | None:
        """The error of ``rep``'s last start from this process if it failed less than
        ``FAILED_HOLD_S`` ago (a request gets it instead of starting the replica again), else None."""
        with self._lock:
            if rep.failed_at is not None and time.monotonic() - rep.failed_at < FAILED_HOLD_S:
                return rep.start_error
        return None

    def _launch(self, index: int) -> Any:
        spec = self.spec
        return self._actor.launch(self.deployment, spec.preset, dict(spec.revision), replica=index,
                                  engine=spec.engine, tensor_parallel_size=spec.tensor_parallel_size)

    def start_all(self) -> list[Any]:
        """Find or launch every configured replica (launched in parallel), wait until each answers;
        returns their handles in index order."""
        self._servable()
        ray = self._join()
        with self._start_lock:
            pending = {}
            for i in self.indices():
                rep = self.replica(i)
                if rep.handle is None:
                    handle = self._actor.find(self.deployment, i)
                    if handle is None:
                        replica_board.report(rep.name, "starting", phase="waiting for the actor (resources)")
                        handle = self._launch(i)
                    pending[i] = (handle, handle.ping.remote())
            for i, (handle, ping) in pending.items():
                try:
                    ray.get(ping, timeout=self._create_timeout)
                except Exception as exc:
                    replica_board.report(self.replica(i).name, "failed", error=_reason(exc))
                    raise
                replica_board.report(self.replica(i).name, "ready")
                with self._lock:
                    self._replicas[i].handle, self._replicas[i].dead = handle, False
        return [self.replica(i).handle for i in self.indices()]

    def _revive(self, rep: Replica) -> None:
        try:
            for delay in REVIVE_BACKOFF_S:
                time.sleep(delay)
                if not self._refresh_spec() or self.closed or rep.index >= self.count or rep.draining:
                    return
                try:
                    self._start_one(rep.index)
                except Exception as exc:
                    logger.info("replica %s not back yet: %r", rep.name, exc)
                    continue
                with self._lock:
                    rep.revivals += 1
                logger.warning("replica %s is back in routing", rep.name)
                return
            logger.error("replica %s did not come back; the next serving call retries", rep.name)
        finally:
            with self._lock:
                rep.reviving = False

    def _refresh_spec(self) -> bool:
        """Re-read the spec; False when the registry no longer has the deployment (deleted): a
        replica of it is never brought back."""
        if self._refresh is None:
            return True
        try:
            spec = self._refresh()
        except Exception as exc:  # the registry is briefly away: keep the last spec seen
            logger.info("could not re-read the spec of %s: %r", self.deployment, exc)
            return True
        if spec is None:
            return False
        self.spec = spec
        return True

    def drain(self, index: int, *, deadline_s: float) -> dict:
        """Scale replica ``index`` away: out of routing now, wait (up to ``deadline_s``) until neither
        this process nor the worker itself runs requests, then kill the actor. Idempotent: a replica
        that does not exist is ``absent``. Returns ``{"replica", "status", "running_at_kill"}``."""
        rep = self.replica(index)
        with self._lock:
            rep.draining = True
        try:
            ray = self._join()
            handle = rep.handle or self._actor.find(self.deployment, index)
            if handle is None:  # a replica whose start failed or was reported shows as stopped; others stay unlisted
                replica_board.report(rep.name, "stopped", known_only=True)
                return {"replica": index, "status": "absent", "running_at_kill": 0}
            replica_board.report(rep.name, "stopping", phase="draining running requests")
            deadline = time.monotonic() + max(0.0, deadline_s)
            running = 0
            while True:
                try:
                    running = int(ray.get(handle.info.remote(), timeout=5).get("running", 0))
                except Exception:
                    running = 0  # it does not answer: nothing to wait for
                    break
                if (running == 0 and rep.inflight == 0) or time.monotonic() >= deadline:
                    break
                time.sleep(DRAIN_POLL_S)
            replica_board.report(rep.name, "stopping", phase="stopping the engine")
            try:  # the engine's own processes (vLLM's engine core) exit before the actor is killed
                ray.get(handle.shutdown.remote(SHUTDOWN_TIMEOUT_S), timeout=SHUTDOWN_TIMEOUT_S + 15)
            except Exception as exc:
                logger.info("replica %s did not shut down cleanly (%r); killing it", rep.name, exc)
            ray.kill(handle, no_restart=True)
            replica_board.report(rep.name, "stopped")
            logger.info("replica %s drained and stopped (%d running at kill)", rep.name, running)
            return {"replica": index, "status": "stopped", "running_at_kill": running}
        finally:
            with self._lock:
                self._replicas.pop(index, None)

    def scale(self, *, deadline_s: float) -> dict:
        """Bring the cluster to the spec's count: start missing replicas below it, drain every replica
        found at or above it (up to ``MAX_REPLICAS``: also orphans of an interrupted scale-down).
        Returns ``{"started": [...], "stopped": [...]}`` (indices)."""
        started, stopped = [], []
        for i in self.indices():
            if self.replica(i).handle is None and self._actor.find(self.deployment, i) is None:
                started.append(i)
        self.start_all()
        for i in range(self.count, MAX_REPLICAS):
            present = self.cached(i) is not None or self._actor.find(self.deployment, i) is not None
            if present and self.drain(i, deadline_s=deadline_s)["status"] == "stopped":
                stopped.append(i)
        return {"started": started, "stopped": stopped}


def _reason(exc: BaseException) -> str:
    """An operator's one-paragraph account of a failed start: the exception's last lines (a Ray error
    carries the actor's traceback; its end names the cause)."""
    text = str(exc).strip() or type(exc).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: " + " | ".join(lines[-3:])[:1000]


def _no_cluster(exc: BaseException) -> bool:
    from controlplane.common.errors import Unavailable

    return isinstance(exc, Unavailable)

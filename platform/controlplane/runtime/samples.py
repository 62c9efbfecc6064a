"""The last ``stats`` sample of every replica, kept per process and refreshed off the request path.

Admin reads (``/api/admin/stats``, ``/metrics``, the console's dashboard and model pages) never call a
replica: ``runtime.stats.cluster_stats`` asks :func:`read`, which answers from the last sample of each
replica with its time (``sampled_at``), its age (``age_s``) and ``stale`` (no sample yet, the last
poll did not get an answer, or the sample is older than ``STALE_S``). The last good figures are kept
when a later poll fails, so a dashboard shows them, marked stale, rather than nothing.

Refresh: one :class:`SampleStore` per process. A read asks for a poll of each replica whose last
poll is older than ``fresh_s`` and waits at most ``wait_s`` for those polls (a replica that answers
at once is shown fresh; one that does not is shown from its last sample). A background thread,
started by the first read and ended after ``IDLE_S`` without reads, polls every replica read recently
each ``INTERVAL_S``. Polls run on a pool of ``MAX_POLLS`` threads, at most one per replica at a time,
each with ``POLL_TIMEOUT_S``; the request thread never makes a Ray call.

A poll first reads Ray's own state of the actor (a lookup in Ray's control store, not a call to the
actor): a replica whose constructor still runs (loading weights, starting vLLM) or that Ray is
restarting is ``starting`` and is not asked. Otherwise it calls ``stats`` through ``gateway.call``
(``create=False``: a poll never starts a replica). Statuses: ``ok``, ``starting``, ``unreachable``,
``not started`` (no actor), ``pending`` (no poll has finished yet).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

logger = logging.getLogger("controlplane.runtime")

INTERVAL_S = 5.0  # the background refresh of every replica read recently
STALE_S = 30.0  # a sample older than this is stale even if its last poll answered
IDLE_S = 120.0  # the background refresh stops this long after the last read (and restarts on the next)
POLL_TIMEOUT_S = 2.0  # one replica's ``stats`` answer
MAX_POLLS = 4  # concurrent polls per process
FRESH_S = 1.0  # a read polls again a replica last polled longer ago than this...
READ_WAIT_S = 0.1  # ...and waits this long at most for those polls
STARTING_STATES = frozenset({"DEPENDENCIES_UNREADY", "PENDING_CREATION", "RESTARTING"})

Key = tuple[str, int]  # (deployment, replica index)


@dataclass
class _Entry:
    spec: Any
    status: str = "pending"
    snap: dict | None = None  # the last figures the replica answered
    sampled_at: float | None = None  # when they were taken (epoch seconds)
    polled_at: float | None = None  # when the last poll ended, answered or not
    error: str | None = None
    future: Future | None = None
    read_at: float = 0.0

    def view(self, now: float) -> dict[str, Any]:
        age = None if self.sampled_at is None else round(max(0.0, now - self.sampled_at), 3)
        out: dict[str, Any] = copy.deepcopy(self.snap) if self.snap is not None else {}
        out.update(status=self.status, age_s=age, stale=self.status != "ok" or age is None or age > STALE_S,
                   sampled_at=None if self.sampled_at is None else
                   datetime.fromtimestamp(self.sampled_at, tz=UTC).isoformat())
        if self.error:
            out["error"] = self.error
        return out


def actor_state(spec, replica: int) -> str | None:
    """Ray's state of replica ``replica``'s actor (``ALIVE``, ``PENDING_CREATION``...), read from Ray's
    control store without calling the actor; None when there is no Ray, no such actor or no answer."""
    import ray

    if not ray.is_initialized():
        return None
    from controlplane.runtime import gateway
    from workers import actor as worker_actor

    try:
        handle = gateway.replica_set(spec).cached(replica) or worker_actor.find(spec.deployment, replica)
        actor_id = getattr(handle, "_actor_id", None)
        if actor_id is None:
            return None
        from ray._private import state  # private, but the one lookup that does not wait on the actor

        return (state.actors(actor_id=actor_id.hex()) or {}).get("State")
    except Exception as exc:
        logger.debug("no Ray state for %s/%s: %r", spec.deployment, replica, exc)
        return None


def poll(spec, replica: int) -> tuple[str, dict | None, str | None]:
    """``(status, figures, error)`` of one replica, on a pool thread: ``starting`` replicas are not asked."""
    from controlplane.common.errors import Unavailable
    from controlplane.runtime import gateway

    if actor_state(spec, replica) in STARTING_STATES:
        return "starting", None, None
    try:
        snap = gateway.call(spec, "stats", create=False, timeout=POLL_TIMEOUT_S, replica=replica)
    except Unavailable as exc:
        return "unreachable", None, exc.message
    if snap is None:
        return "not started", None, None
    return "ok", snap, None


class SampleStore:
    """The last sample of each replica this process was asked about. Thread-safe."""

    def __init__(self, *, poll: Callable[[Any, int], tuple[str, dict | None, str | None]] = poll,
                 clock: Callable[[], float] = time.time, max_polls: int = MAX_POLLS) -> None:
        self._poll, self._clock = poll, clock
        self._lock = threading.Lock()
        self._entries: dict[Key, _Entry] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_polls, thread_name_prefix="strata-stats-poll")
        self._loop: threading.Thread | None = None
        self.polls = 0  # polls finished (tests wait on it)

    # ------------------------------------------------------------------ reads (the request path)
    def read(self, targets: Iterable[tuple[Any, int]], *, fresh_s: float | None = None,
             wait_s: float | None = None) -> dict[Key, dict[str, Any]]:
        """``{(deployment, replica): view}`` of ``targets`` (``(spec, replica)`` pairs). Never calls a
        replica: polls those last polled over ``fresh_s`` ago and waits up to ``wait_s`` for them."""
        fresh_s = _setting("STRATA_STATS_FRESH_SECONDS", FRESH_S) if fresh_s is None else fresh_s
        wait_s = _setting("STRATA_STATS_READ_WAIT_SECONDS", READ_WAIT_S) if wait_s is None else wait_s
        now = self._clock()
        keys: list[Key] = []
        waiting: list[Future] = []
        with self._lock:
            for spec, replica in targets:
                key = (spec.deployment, replica)
                entry = self._entries.get(key)
                if entry is None:
                    entry = self._entries[key] = _Entry(spec=spec)
                entry.spec, entry.read_at = spec, now
                keys.append(key)
                if entry.future is None and (entry.polled_at is None or now - entry.polled_at >= fresh_s):
                    self._submit(key, entry)
                if entry.future is not None:
                    waiting.append(entry.future)
            self._ensure_loop()
        if waiting and wait_s > 0:
            wait_for(waiting, timeout=wait_s)
        now = self._clock()
        with self._lock:
            return {key: self._entries[key].view(now) for key in keys}

    def refresh(self, targets: Iterable[tuple[Any, int]], *, timeout: float = POLL_TIMEOUT_S + 5) -> None:
        """Poll ``targets`` now and wait for the answers (up to ``timeout``): for background callers
        (the time-series sampler), never a request."""
        futures = []
        with self._lock:
            for spec, replica in targets:
                key = (spec.deployment, replica)
                entry = self._entries.setdefault(key, _Entry(spec=spec))
                entry.spec = spec
                if entry.future is None:
                    self._submit(key, entry)
                futures.append(entry.future)
        wait_for(futures, timeout=timeout)

    def forget(self, deployment: str | None = None) -> None:
        """Drop the samples of ``deployment`` (all when None): a deleted or replaced deployment."""
        with self._lock:
            for key in [k for k in self._entries if deployment is None or k[0] == deployment]:
                del self._entries[key]

    # ------------------------------------------------------------------ polls (pool threads)
    def _submit(self, key: Key, entry: _Entry) -> None:  # under the lock
        entry.future = self._pool.submit(self._run, key, entry.spec)

    def _run(self, key: Key, spec) -> None:
        try:
            status, snap, error = self._poll(spec, key[1])
        except Exception as exc:  # a poll never takes the store down
            logger.warning("stats poll of %s/%s failed: %r", key[0], key[1], exc)
            status, snap, error = "unreachable", None, type(exc).__name__
        now = self._clock()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:  # forgotten meanwhile
                return
            entry.status, entry.error, entry.polled_at, entry.future = status, error, now, None
            if snap is not None:
                entry.snap, entry.sampled_at = snap, now
            elif status == "not started":  # no actor: its old figures describe nothing that runs
                entry.snap, entry.sampled_at = None, None
            self.polls += 1

    # ------------------------------------------------------------------ the background refresh
    def _ensure_loop(self) -> None:  # under the lock
        if self._loop is None or not self._loop.is_alive():
            self._loop = threading.Thread(target=self._refresh_loop, name="strata-stats-sampler", daemon=True)
            self._loop.start()

    def _refresh_loop(self) -> None:
        interval = _setting("STRATA_STATS_INTERVAL_SECONDS", INTERVAL_S)
        while True:
            time.sleep(interval)
            now = self._clock()
            with self._lock:
                live = [(k, e) for k, e in self._entries.items() if now - e.read_at < IDLE_S]
                if not live:
                    self._loop = None
                    return
                for key, entry in live:
                    if entry.future is None and (entry.polled_at is None or now - entry.polled_at >= interval / 2):
                        self._submit(key, entry)


def _setting(name: str, default: float) -> float:
    return float(getattr(settings, name, default))


_store: SampleStore | None = None
_store_lock = threading.Lock()


def store() -> SampleStore:
    """This process's sample store (one per process)."""
    global _store
    if _store is None:
        with _store_lock:
            if _store is None:
                _store = SampleStore()
    return _store


def read(targets: Iterable[tuple[Any, int]]) -> dict[Key, dict[str, Any]]:
    """The last sample of each ``(spec, replica)`` (see :meth:`SampleStore.read`)."""
    return store().read(targets)

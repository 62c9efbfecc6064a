"""The replica board: each replica's start state, shared by every process of the cluster.

A replica's state (``starting`` with its phase, ``ready``, ``failed`` with its error, ``stopping``,
``stopped``) is written by whoever knows it: the control-plane process that starts or stops the replica
(``controlplane.runtime.replicas``) and the replica's actor itself while it builds its engine
(``workers.actor``: "loading weights", "starting the vLLM engine"...). It is read by every web and
Celery process (``/readyz``, the admin API, the console). One process's memory would not do: the
replica may be started by another web process, and a Celery worker answers nothing about it.

The board is one small named, detached Ray actor (``strata-replica-board``, no CPU), created by the
first process that reports; it holds only these states (lost with the cluster, like the replicas).
:class:`ReplicaBoard` is the plain class (testable without Ray); :func:`report` and :func:`snapshot`
are the calls, and neither ever raises: a board that cannot be reached is a state nobody sees, never
a failed start or a failed page.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("workers.replica_board")

NAME = "strata-replica-board"
NAMESPACE = "strata"
STATES = frozenset({"starting", "ready", "failed", "stopping", "stopped"})
ERROR_CHARS = 2000  # an error kept for operators (a traceback's last lines)


class ReplicaBoard:
    """``{replica actor name: {"state", "since", "phase", "error", "updated"}}``. A report of the state a
    replica is already in keeps its ``since`` (so several processes starting one replica agree on when
    it began) and updates its phase; another state starts a new ``since``."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._states: dict[str, dict[str, Any]] = {}

    def report(self, name: str, state: str, phase: str | None = None, error: str | None = None,
               known_only: bool = False) -> dict:
        """Record ``state``; with ``known_only`` only for a replica the board already holds (a drain of
        a replica that never existed has nothing to say). Returns the entry ({} when not recorded)."""
        if state not in STATES:
            raise ValueError(f"unknown replica state {state!r}")
        now = self._clock()
        old = self._states.get(name)
        if old is None and known_only:
            return {}
        if old is not None and old["state"] == state:
            entry = {**old, "updated": now}
            if phase is not None:
                entry["phase"] = phase
            if error is not None and not old.get("error"):
                entry["error"] = error[-ERROR_CHARS:]
        else:
            entry = {"state": state, "since": now, "updated": now, "phase": phase,
                     "error": error[-ERROR_CHARS:] if error else None}
        self._states[name] = entry
        return dict(entry)

    def forget(self, prefix: str) -> int:
        """Drop every state of replicas named ``prefix...`` (a deleted deployment's); how many."""
        gone = [name for name in self._states if name.startswith(prefix)]
        for name in gone:
            del self._states[name]
        return len(gone)

    def snapshot(self, prefix: str = "") -> dict[str, dict]:
        """Every state whose replica name starts with ``prefix``, with ``now`` (the board's clock)."""
        now = self._clock()
        return {name: {**entry, "now": now} for name, entry in self._states.items() if name.startswith(prefix)}


_remote = None  # ray.remote(ReplicaBoard), made once per process


def _board():
    import ray

    global _remote
    if _remote is None:
        _remote = ray.remote(ReplicaBoard)
    return _remote.options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=4,
    ).remote()


def report(name: str, state: str, *, phase: str | None = None, error: str | None = None,
           known_only: bool = False) -> None:
    """Fire-and-forget: record replica ``name``'s ``state`` (``known_only``: only if the board holds
    it already). Never raises, never waits for the board."""
    try:
        import ray

        if ray.is_initialized():
            _board().report.remote(name, state, phase, error, known_only)
    except Exception as exc:  # the board is a view: a start never fails for it
        logger.info("could not report %s as %s: %r", name, state, exc)


def forget(prefix: str) -> None:
    """Fire-and-forget: drop the states of every replica named ``prefix...`` (a deleted deployment's,
    so a model created again under its name starts with none). Never raises."""
    try:
        import ray

        if ray.is_initialized():
            _board().forget.remote(prefix)
    except Exception as exc:
        logger.info("could not forget %s: %r", prefix, exc)


def snapshot(prefix: str = "", *, timeout: float = 2.0) -> dict[str, dict] | None:
    """Blocking, at most ``timeout`` seconds: the board's states of replicas named ``prefix...``; None
    when it cannot be read (no Ray, the board did not answer). Never raises."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get(_board().snapshot.remote(prefix), timeout=timeout)
    except Exception as exc:
        logger.info("replica board unreadable: %r", exc)
        return None

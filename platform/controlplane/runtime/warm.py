"""Warm starts: a deployment's replicas start when the platform starts (``start_at_startup``, called
by the web process: ``controlplane.asgi``) and when the deployment is created or granted
(``warm_after_commit``), in the background, so that no request waits for a cold engine start
(seconds on the reference engine, minutes for a real checkpoint on vLLM).

Every web process runs the startup hook; each replica still starts once: a replica is a named Ray
actor launched with ``get_if_exists``, so the second process finds the first one's. Nothing here
blocks the caller: the starts run in threads (``ReplicaSet.start_async``), report their progress to
the replica board (``runtime.replica_states`` reads it) and a failure is only logged there; a request
that comes meanwhile waits a bounded time (``runtime.dispatch``).

``STRATA_WARM_REPLICAS`` (``strata_env.warm_replicas``): unset means on where a Ray cluster is
configured (``RAY_ADDRESS``: ``make run`` and compose's web), off elsewhere (tests, which start Ray
themselves); ``0`` turns warm starts off (replicas then start on their first request), ``1`` on.
A stopped deployment (``replicas = 0``) never starts here, nor one whose active revision's weights are
still being hashed (``WorkerSpec.unservable``): ``hashing.services`` warms it when its digest lands.
"""

from __future__ import annotations

import logging
import threading
import time

from django.db import transaction

import strata_env

logger = logging.getLogger("controlplane.runtime")

FLAG = strata_env.WARM_REPLICAS
STARTUP_TRIES_S = (0.0, 2.0, 5.0, 10.0, 20.0)  # the database may come up after the web process


def enabled() -> bool:
    return strata_env.warm_replicas()


def start_replicas(spec) -> int:
    """Start every configured replica of ``spec``'s deployment in the background (those running are
    found); returns how many starts were asked. Never blocks, never raises."""
    from controlplane.runtime import gateway

    if spec.unservable is not None:
        return 0
    try:
        rs = gateway.replica_set(spec)
        for index in rs.indices():
            rs.start_async(index)
        return len(rs.indices())
    except Exception as exc:
        logger.warning("warming %s failed (%r): its first request starts it", spec.deployment, exc)
        return 0


def warm_after_commit(deployment) -> None:
    """Start ``deployment``'s replicas once the current transaction commits (when ``enabled``)."""
    if not enabled() or deployment.active_revision_id is None or deployment.replicas == 0:
        return
    from controlplane.runtime import gateway

    spec = gateway.spec_for(deployment)
    transaction.on_commit(lambda: start_replicas(spec))


def warm_all() -> dict[str, int]:
    """Blocking (database reads; the starts run in the background): start the replicas of every
    deployment with an active revision and replicas. Returns ``{deployment: starts asked}``."""
    from django.db import connection

    from controlplane.registry.models import ModelDeployment
    from controlplane.runtime import gateway

    try:
        deployments = list(ModelDeployment.objects.select_related("active_revision")
                           .filter(active_revision__isnull=False, replicas__gt=0).order_by("name"))
    finally:
        connection.close()
    return {d.name: start_replicas(gateway.spec_for(d)) for d in deployments}


def start_at_startup() -> threading.Thread | None:
    """The web process's startup hook: ``warm_all`` in a daemon thread (retried while the database is
    not reachable yet) when ``enabled``. Returns the thread (None when disabled)."""
    if not enabled():
        return None

    def run() -> None:
        for delay in STARTUP_TRIES_S:
            time.sleep(delay)
            try:
                started = warm_all()
            except Exception as exc:
                logger.warning("warm start at startup: registry unreadable (%r); retrying", exc)
                continue
            logger.info("warm start at startup: %s", started or "no deployment with replicas")
            return
        logger.error("warm start at startup gave up: replicas start on their first request")

    thread = threading.Thread(target=run, name="warm-startup", daemon=True)
    thread.start()
    return thread

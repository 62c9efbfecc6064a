"""Warm starts: a deployment's replicas are started when it is created or granted, so its first
request does not wait for a cold engine start (seconds). Only where a process asks for it
(``STRATA_WARM_REPLICAS=1``: ``make run`` sets it for the web process, which is already a Ray
driver); elsewhere (tests, management commands, Celery) creating a model starts nothing.

The start runs after the transaction commits, in a daemon thread, and a failure is only logged:
the first request then starts the replicas as before."""

from __future__ import annotations

import logging
import threading

from django.db import transaction

import strata_env

logger = logging.getLogger("controlplane.runtime")

FLAG = strata_env.WARM_REPLICAS


def enabled() -> bool:
    return strata_env.warm_replicas()


def warm_after_commit(deployment) -> None:
    """Start ``deployment``'s replicas once the current transaction commits (when ``enabled``)."""
    if not enabled() or deployment.active_revision_id is None:
        return
    name = deployment.name
    transaction.on_commit(lambda: threading.Thread(target=_warm, args=(name,), name=f"warm-{name}",
                                                   daemon=True).start())


def _warm(name: str) -> None:
    from django.db import connection

    from controlplane.registry.models import ModelDeployment
    from controlplane.runtime import gateway

    try:
        deployment = ModelDeployment.objects.select_related("active_revision").get(name=name)
        gateway.get_worker(gateway.spec_for(deployment), create=True)  # every configured replica
        logger.info("warmed the replicas of %s", name)
    except Exception as exc:  # the first request starts them instead
        logger.warning("warming %s failed (%s): its first request starts it", name, exc)
    finally:
        connection.close()
